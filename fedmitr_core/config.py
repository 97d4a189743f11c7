"""Typed run configuration, parsed and validated once from Flower's run config.

Every run-config key is the kebab-case name of one field below
(``local_epochs`` <-> ``local-epochs``). The defaults here are the defaults of
``[tool.flwr.app.config]`` in ``pyproject.toml`` (a test keeps them equal).

Precedence: dataclass defaults < a YAML preset (``preset=<name>``, loaded from
``sim_configs/<name>.yaml``) < keys whose value differs from the default.
Flower hands the app one merged dict, so a key passed explicitly with its
default value cannot be told apart from the default; then the preset wins.
"""

from __future__ import annotations

import difflib
import math
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

DatasetName = Literal["digits", "cifar10", "cifar100", "imagefolder"]
PartitionerName = Literal["dirichlet", "pathological", "iid"]
Weighting = Literal["uniform", "samples", "class"]
EnsembleForm = Literal["auto", "loop", "vmap"]
DeviceName = Literal["auto", "cpu", "cuda"]
Precision = Literal["auto", "fp32", "bf16"]
InversionObjective = Literal["per-teacher", "mixture"]
PrunedPatches = Literal["blank", "keep"]
TokenRanking = Literal["attention", "random"]
LowLabel = Literal["low-tokens", "full-image"]
StudentInit = Literal["fedavg", "scratch"]
StudentTokens = Literal["kept", "kept-live", "all"]
TokenHeadInit = Literal["random", "cls-head"]
StatsTeachers = Literal["uniform", "class", "class-moments"]
StatsPruned = Literal["kept", "frozen"]
FallbackPrior = Literal["none", "patch-similarity"]
PrivateStats = Literal["gaussian", "off"]
# Kept equal to fedmitr_core.models.MODEL_PRESETS and fedmitr_core.methods.METHODS by tests.
ModelName = Literal["vit-micro", "vit-tiny", "vit-small"]
OneShotMethod = Literal["fedmitr", "deepinversion", "fedmitr-sparse", "fedmitr-relabel",
                        "fedavg", "kd-real", "dense", "coboosting", "fedftg"]
RoundMethod = Literal["fedavg-rounds"]  # needs more rounds with the clients
MethodName = Literal[OneShotMethod, RoundMethod]

SIM_CONFIGS_DIR = Path(__file__).resolve().parents[1] / "sim_configs"
# ``feature-stats-layers``: a name or comma-separated layer indices.
LAYER_SPEC = re.compile(r"^(all|all-but-last|\s*\d+(\s*,\s*\d+)*\s*)$")


class ConfigError(ValueError):
    """A run-config key has a value outside what it accepts."""


def _fail(key: str, expected: str, value: Any) -> None:
    raise ConfigError(f"run config key '{key}': expected {expected}, got {value!r}")


def _check(ok: bool, key: str, expected: str, value: Any) -> None:
    if not ok:
        _fail(key, expected, value)


@dataclass(frozen=True)
class DataConfig:
    """Which dataset, where it lives and how it is split."""

    dataset: DatasetName = "digits"
    data_dir: str = "data"
    download: bool = False
    image_size: int = 16
    val_fraction: float = 0.1
    test_fraction: float = 0.2

    def __post_init__(self) -> None:
        _check(self.image_size >= 4, "image-size", "an integer >= 4", self.image_size)
        _check(0.0 <= self.val_fraction < 0.5, "val-fraction", "a float in [0, 0.5)",
               self.val_fraction)
        _check(0.0 < self.test_fraction < 0.9, "test-fraction", "a float in (0, 0.9)",
               self.test_fraction)


@dataclass(frozen=True)
class PartitionConfig:
    """How the training split is divided among clients (flwr-datasets partitioners)."""

    partitioner: PartitionerName = "dirichlet"
    alpha: float = 0.5
    classes_per_client: int = 2
    min_partition_size: int = 2

    def __post_init__(self) -> None:
        _check(self.alpha > 0 and math.isfinite(self.alpha), "alpha",
               "a finite float > 0", self.alpha)
        _check(self.classes_per_client >= 1, "classes-per-client", "an integer >= 1",
               self.classes_per_client)
        _check(self.min_partition_size >= 0, "min-partition-size", "an integer >= 0",
               self.min_partition_size)


@dataclass(frozen=True)
class ModelConfig:
    """Which ViT every client and the student use."""

    model: ModelName = "vit-micro"
    patch_size: int = 4
    pretrained: str = ""

    def __post_init__(self) -> None:
        _check(self.patch_size >= 1, "patch-size", "an integer >= 1", self.patch_size)


@dataclass(frozen=True)
class ClientConfig:
    """Local training on each client."""

    local_epochs: int = 80
    local_batch_size: int = 16
    local_lr: float = 0.002
    local_weight_decay: float = 0.05
    local_shift: int = 1
    client_stats: bool = True

    def __post_init__(self) -> None:
        _check(self.local_epochs >= 1, "local-epochs", "an integer >= 1", self.local_epochs)
        _check(self.local_batch_size >= 1, "local-batch-size", "an integer >= 1",
               self.local_batch_size)
        _check(self.local_lr > 0, "local-lr", "a float > 0", self.local_lr)
        _check(self.local_weight_decay >= 0, "local-weight-decay", "a float >= 0",
               self.local_weight_decay)
        _check(self.local_shift >= 0, "local-shift", "an integer >= 0 (pixels)",
               self.local_shift)


@dataclass(frozen=True)
class PrivacyConfig:
    """Differentially private clients (DP-SGD with Opacus); off by default.

    A client is private when ``dp-epsilon`` is finite (the noise is calibrated so
    its whole release spends that ε at ``dp-delta``) or ``dp-noise-multiplier`` is
    set (the ε it spends is reported). A private client's label counts, and its
    token statistics unless ``dp-stats=off``, are released with the Gaussian
    mechanism at ``dp-release-noise`` under the same accountant; statistics are
    per-image clipped to L2 norm ``dp-stats-clip`` first.
    """

    dp_epsilon: float = math.inf
    dp_noise_multiplier: float = 0.0
    dp_clip: float = 1.0
    dp_delta: float = 1e-5
    dp_stats: PrivateStats = "gaussian"
    dp_stats_clip: float = 8.0
    dp_release_noise: float = 10.0

    @property
    def private(self) -> bool:
        """Whether clients train and release under differential privacy."""
        return math.isfinite(self.dp_epsilon) or self.dp_noise_multiplier > 0

    def __post_init__(self) -> None:
        _check(self.dp_epsilon > 0, "dp-epsilon", "a float > 0 (inf: not private)",
               self.dp_epsilon)
        _check(self.dp_noise_multiplier >= 0, "dp-noise-multiplier",
               "a float >= 0 (0: calibrated to dp-epsilon)", self.dp_noise_multiplier)
        _check(not (math.isfinite(self.dp_epsilon) and self.dp_noise_multiplier > 0),
               "dp-noise-multiplier", "0 when dp-epsilon is set (one or the other)",
               self.dp_noise_multiplier)
        _check(self.dp_clip > 0, "dp-clip", "a float > 0", self.dp_clip)
        _check(0 < self.dp_delta < 1, "dp-delta", "a float in (0, 1)", self.dp_delta)
        _check(self.dp_stats_clip > 0, "dp-stats-clip", "a float > 0", self.dp_stats_clip)
        _check(self.dp_release_noise > 0, "dp-release-noise", "a float > 0",
               self.dp_release_noise)


@dataclass(frozen=True)
class InversionConfig:
    """Model inversion of the client ensemble (sparse for FedMITR, dense for DI)."""

    syn_images: int = 600
    syn_batch_size: int = 300
    inv_iterations: int = 40
    inv_lr: float = 0.25
    inv_beta1: float = 0.5
    inv_beta2: float = 0.99
    inv_tv: float = 1e-3
    inv_l2: float = 1e-5
    inv_jitter: int = 1
    inv_flip: bool = False
    inv_objective: InversionObjective = "per-teacher"
    prune_at: tuple[float, ...] = (0.3, 0.6)
    prune_ratio: float = 0.3
    keep_ratio: float = 0.5
    pruned_patches: PrunedPatches = "blank"
    token_ranking: TokenRanking = "attention"
    low_label: LowLabel = "low-tokens"

    def __post_init__(self) -> None:
        _check(self.syn_images >= 1, "syn-images", "an integer >= 1", self.syn_images)
        _check(self.syn_batch_size >= 1, "syn-batch-size", "an integer >= 1",
               self.syn_batch_size)
        _check(self.inv_iterations >= 1, "inv-iterations", "an integer >= 1",
               self.inv_iterations)
        _check(self.inv_lr > 0, "inv-lr", "a float > 0", self.inv_lr)
        _check(0 <= self.inv_beta1 < 1, "inv-beta1", "a float in [0, 1)", self.inv_beta1)
        _check(0 <= self.inv_beta2 < 1, "inv-beta2", "a float in [0, 1)", self.inv_beta2)
        _check(self.inv_tv >= 0, "inv-tv", "a float >= 0", self.inv_tv)
        _check(self.inv_l2 >= 0, "inv-l2", "a float >= 0", self.inv_l2)
        _check(self.inv_jitter >= 0, "inv-jitter", "an integer >= 0 (pixels)",
               self.inv_jitter)
        _check(all(0 < p < 1 for p in self.prune_at), "prune-at",
               "comma-separated fractions of the iterations, each in (0, 1)", self.prune_at)
        _check(0 < self.prune_ratio < 1, "prune-ratio", "a float in (0, 1)", self.prune_ratio)
        _check(0 < self.keep_ratio <= 1, "keep-ratio", "a float in (0, 1]", self.keep_ratio)


@dataclass(frozen=True)
class PriorConfig:
    """The token-statistics prior of every data-free method (DESIGN.md §9).

    ``feature-stats`` turns it on or off for every method of the run;
    ``feature-stats-weight`` weighs it in inversion (FedMITR, DeepInversion), the
    baselines have their own weights (``dense-stats``, ``coboost-stats``,
    ``fedftg-stats``). ``feature-stats-layers``: ``all-but-last``, ``all`` or
    comma-separated layer indices (0: the embedding, ``i + 1``: block ``i``).
    ``feature-stats-teachers``: each teacher's term weighted ``uniform`` or by
    its share of the batch's target classes (``class``), or that and each teacher's
    moments taken over the images of its classes (``class-moments``, the default
    chosen on the validation split; with ``kept`` only). ``feature-stats-pruned``:
    under sparse inversion, match the moments of the ``kept`` tokens, or of the kept
    and the pruned ones at their features when pruned (``frozen``). ``fallback-prior``:
    what covers the teachers without statistics (all of them when
    ``feature-stats`` is false): ``none`` or ``patch-similarity`` (PSAQ-ViT's
    patch-similarity entropy) at ``fallback-prior-weight``.
    """

    feature_stats: bool = True
    feature_stats_weight: float = 10.0
    feature_stats_layers: str = "all-but-last"
    feature_stats_teachers: StatsTeachers = "class-moments"
    feature_stats_pruned: StatsPruned = "kept"
    fallback_prior: FallbackPrior = "none"
    fallback_prior_weight: float = 1.0

    def __post_init__(self) -> None:
        _check(self.fallback_prior_weight >= 0, "fallback-prior-weight", "a float >= 0",
               self.fallback_prior_weight)
        _check(self.feature_stats_weight >= 0, "feature-stats-weight", "a float >= 0",
               self.feature_stats_weight)
        _check(bool(LAYER_SPEC.match(self.feature_stats_layers)), "feature-stats-layers",
               "'all-but-last', 'all' or comma-separated layer indices (0: the embedding)",
               self.feature_stats_layers)
        _check(self.feature_stats_teachers != "class-moments"
               or self.feature_stats_pruned == "kept", "feature-stats-pruned",
               "'kept' while feature-stats-teachers is class-moments ('frozen' needs "
               "feature-stats-teachers=uniform or class)", self.feature_stats_pruned)


@dataclass(frozen=True)
class DistillConfig:
    """Training the global student on the synthetic pool."""

    distill_epochs: int = 50
    distill_batch_size: int = 64
    distill_lr: float = 0.003
    distill_weight_decay: float = 0.05
    temperature: float = 3.0
    kd_weight: float = 1.0
    hi_weight: float = 0.1
    lo_weight: float = 0.1
    hi_agreed_only: bool = False
    student_init: StudentInit = "fedavg"
    student_tokens: StudentTokens = "kept-live"
    token_head_init: TokenHeadInit = "random"
    live_mix: float = 1.0
    live_shift: int = 2
    live_every: int = 1

    def __post_init__(self) -> None:
        _check(0 <= self.live_mix <= 1, "live-mix", "a float in [0, 1]", self.live_mix)
        _check(self.live_shift >= 0, "live-shift", "an integer >= 0 (pixels)", self.live_shift)
        _check(self.live_every >= 1, "live-every", "an integer >= 1 (student steps)",
               self.live_every)
        _check(self.distill_epochs >= 1, "distill-epochs", "an integer >= 1",
               self.distill_epochs)
        _check(self.distill_batch_size >= 1, "distill-batch-size", "an integer >= 1",
               self.distill_batch_size)
        _check(self.distill_lr > 0, "distill-lr", "a float > 0", self.distill_lr)
        _check(self.distill_weight_decay >= 0, "distill-weight-decay", "a float >= 0",
               self.distill_weight_decay)
        _check(self.temperature > 0, "temperature", "a float > 0", self.temperature)
        for key in ("kd_weight", "hi_weight", "lo_weight"):
            value = getattr(self, key)
            _check(value >= 0, key.replace("_", "-"), "a float >= 0", value)


@dataclass(frozen=True)
class BaselineConfig:
    """The generator-based baselines: DENSE, Co-Boosting and FedFTG (DESIGN.md §4).

    They share the budget keys with the inversion methods: ``syn-images``
    synthetic images in all, made in ``gen-rounds`` rounds, and as many student
    steps as ``distill-epochs`` epochs over ``syn-images`` images.
    """

    gen_rounds: int = 10
    gen_steps: int = 30
    gen_lr: float = 1e-3
    gen_nz: int = 256
    gen_width: int = 64
    dense_oh: float = 1.0
    dense_adv: float = 1.0
    dense_temperature: float = 20.0
    coboost_oh: float = 1.0
    coboost_adv: float = 1.0
    coboost_hard_power: float = 1.0
    coboost_adv_temperature: float = 3.0
    coboost_mu: float = 0.01
    coboost_mu_decay: float = 0.99
    coboost_ods_eps: float = 8 / 255
    coboost_temperature: float = 4.0
    fedftg_ce: float = 1.0
    fedftg_adv: float = 1.0
    fedftg_div: float = 1.0
    fedftg_temperature: float = 1.0
    fedftg_lr: float = 0.001
    dense_stats: float = 1.0
    coboost_stats: float = 1.0
    fedftg_stats: float = 1.0

    def __post_init__(self) -> None:
        for key in ("gen_rounds", "gen_steps", "gen_nz", "gen_width"):
            value = getattr(self, key)
            _check(value >= 1, key.replace("_", "-"), "an integer >= 1", value)
        for key in ("gen_lr", "fedftg_lr", "dense_temperature", "coboost_adv_temperature",
                    "coboost_temperature", "fedftg_temperature"):
            value = getattr(self, key)
            _check(value > 0, key.replace("_", "-"), "a float > 0", value)
        for key in ("dense_oh", "dense_adv", "coboost_oh", "coboost_adv", "coboost_hard_power",
                    "coboost_mu", "coboost_ods_eps", "fedftg_ce", "fedftg_adv", "fedftg_div",
                    "dense_stats", "coboost_stats", "fedftg_stats"):
            value = getattr(self, key)
            _check(value >= 0, key.replace("_", "-"), "a float >= 0", value)
        _check(0 < self.coboost_mu_decay <= 1, "coboost-mu-decay", "a float in (0, 1]",
               self.coboost_mu_decay)


@dataclass(frozen=True)
class RuntimeConfig:
    """Where clients and server compute, and in which precision."""

    device: DeviceName = "auto"
    precision: Precision = "auto"


@dataclass(frozen=True)
class ServerConfig:
    """What the server runs and where it writes."""

    methods: tuple[MethodName, ...] = ("fedmitr", "deepinversion")
    weighting: Weighting = "class"
    ensemble_form: EnsembleForm = "auto"
    teachers_per_class: int = 0
    min_clients: int = 0
    round_timeout: float = 3600.0
    num_rounds: int = 10
    output_dir: str = "outputs"
    run_name: str = ""
    checkpoint_every: int = 10
    resume_from: str = ""
    max_weight_ratio: float = 20.0
    outlier_ratio: float = 5.0
    count_cap: float = 5.0
    privacy_audit: bool = False

    def __post_init__(self) -> None:
        _check(len(self.methods) >= 1, "methods", "at least one method name", self.methods)
        _check(self.methods[0] in get_args(OneShotMethod), "methods",
               "a one-shot method first (it is the saved global model)", self.methods[0])
        _check(self.num_rounds >= 2, "num-rounds", "an integer >= 2 (rounds of fedavg-rounds)",
               self.num_rounds)
        _check(self.teachers_per_class >= 0, "teachers-per-class",
               "an integer >= 0 (0: every client is a teacher)", self.teachers_per_class)
        _check(self.min_clients >= 0, "min-clients", "an integer >= 0 (0: all partitions)",
               self.min_clients)
        _check(self.round_timeout > 0, "round-timeout", "a float > 0 (seconds)",
               self.round_timeout)
        _check(self.checkpoint_every >= 0, "checkpoint-every",
               "an integer >= 0 (distillation epochs; 0 turns checkpoints off)",
               self.checkpoint_every)
        for key, value in (("max-weight-ratio", self.max_weight_ratio),
                           ("outlier-ratio", self.outlier_ratio), ("count-cap", self.count_cap)):
            _check(value == 0 or (value >= 1 and math.isfinite(value)), key,
                   "0 (off) or a finite float >= 1", value)
        if self.resume_from:
            uploads = Path(self.resume_from).expanduser() / "uploads"
            _check(uploads.is_dir(), "resume-from",
                   "a run folder holding the persisted uploads in 'uploads/'", self.resume_from)
        _check("/" not in self.run_name and self.run_name not in (".", ".."), "run-name",
               "a folder name without '/'", self.run_name)


@dataclass(frozen=True)
class FedMITRConfig:
    """The whole run: one section per concern."""

    seed: int = 0
    preset: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    inversion: InversionConfig = field(default_factory=InversionConfig)
    prior: PriorConfig = field(default_factory=PriorConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        _check(self.data.image_size % self.model.patch_size == 0, "patch-size",
               f"a divisor of image-size={self.data.image_size}", self.model.patch_size)

    def to_flat(self) -> dict[str, Any]:
        """The config as flat kebab-case keys (what ``config.yaml`` holds)."""
        flat: dict[str, Any] = {"seed": self.seed, "preset": self.preset}
        for section in _SECTIONS:
            for f in fields(section):
                value = getattr(getattr(self, _section_attr(section)), f.name)
                flat[_key(f.name)] = list(value) if isinstance(value, tuple) else value
        return flat


_SECTION_ATTRS: dict[type, str] = {
    DataConfig: "data", PartitionConfig: "partition", ModelConfig: "model",
    ClientConfig: "client", PrivacyConfig: "privacy", InversionConfig: "inversion",
    PriorConfig: "prior", DistillConfig: "distill",
    BaselineConfig: "baseline", RuntimeConfig: "runtime", ServerConfig: "server",
}
_SECTIONS = tuple(_SECTION_ATTRS)


def _section_attr(section: type) -> str:
    return _SECTION_ATTRS[section]


def _key(name: str) -> str:
    return name.replace("_", "-")


def _field_types(section: type) -> dict[str, Any]:
    return typing.get_type_hints(section)


def _cast(key: str, value: Any, hint: Any) -> Any:
    origin = get_origin(hint)
    if origin is Literal:
        options = get_args(hint)
        _check(value in options, key, f"one of {list(options)}", value)
        return value
    if origin is tuple:
        item_type = get_args(hint)[0]
        if isinstance(value, str):
            items = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            items = [value]
        return tuple(_cast(key, v, item_type) for v in items)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        _fail(key, "a boolean (true/false)", value)
    if hint is int:
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        ):
            _fail(key, "an integer", value)
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                return float(value)
            except (TypeError, ValueError):
                _fail(key, "a number", value)
        return float(value)
    if hint is str:
        # TOML and YAML read a bare index (feature-stats-layers=0) as an integer.
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        _check(isinstance(value, str), key, "a string", value)
        return value
    raise TypeError(f"no cast for run config key '{key}' of type {hint!r}")


def default_flat_config() -> dict[str, Any]:
    """Flat kebab-case defaults, as ``[tool.flwr.app.config]`` should list them."""
    flat = FedMITRConfig().to_flat()
    return {k: (",".join(map(str, v)) if isinstance(v, list) else v) for k, v in flat.items()}


def load_preset(name: str, presets_dir: Path = SIM_CONFIGS_DIR) -> dict[str, Any]:
    """Read ``sim_configs/<name>.yaml`` as a flat mapping of run-config keys."""
    path = presets_dir / f"{name}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in presets_dir.glob("*.yaml"))
        _fail("preset", f"a file sim_configs/<name>.yaml, one of {available}", name)
    with path.open(encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"preset file '{path}': expected a mapping of run-config keys")
    overrides = data.get("run-config", data)
    if not isinstance(overrides, dict):
        raise ConfigError(f"preset file '{path}': 'run-config' must be a mapping")
    return dict(overrides)


def parse_overrides(items: list[str], flag: str) -> dict[str, Any]:
    """``key=value`` strings from a command line as a mapping (values read as YAML).

    ``key=`` gives the empty string (e.g. ``prune-at=``: no prune steps).
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"{flag} '{item}': expected key=value")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return out


def parse_config(run_config: Mapping[str, Any], presets_dir: Path = SIM_CONFIGS_DIR
                 ) -> FedMITRConfig:
    """Build and validate the typed config from a flat run-config mapping.

    Parameters
    ----------
    run_config
        Flat kebab-case keys, as Flower's ``context.run_config`` holds them.
    presets_dir
        Where ``preset=<name>`` looks for ``<name>.yaml``.

    Raises
    ------
    ConfigError
        Naming the first key that is unknown or out of range.
    """
    defaults = default_flat_config()
    known = set(defaults)
    for key in run_config:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown run config key '{key}'{hint}")
    merged: dict[str, Any] = dict(defaults)
    preset = run_config.get("preset", "")
    if preset:
        values = load_preset(str(preset), presets_dir)
        for key in values:
            if key not in known or key == "preset":
                raise ConfigError(f"preset '{preset}': unknown run config key '{key}'")
        merged.update(values)
    for key, value in run_config.items():
        if value != defaults[key]:
            merged[key] = value

    top_hints = _field_types(FedMITRConfig)
    sections: dict[str, Any] = {}
    for section in _SECTIONS:
        hints = _field_types(section)
        kwargs = {f.name: _cast(_key(f.name), merged[_key(f.name)], hints[f.name])
                  for f in fields(section)}
        sections[_section_attr(section)] = section(**kwargs)
    return FedMITRConfig(
        seed=_cast("seed", merged["seed"], top_hints["seed"]),
        preset=_cast("preset", merged["preset"], top_hints["preset"]),
        **sections,
    )


__all__ = [
    "ConfigError",
    "FedMITRConfig",
    "MethodName",
    "ModelName",
    "default_flat_config",
    "load_preset",
    "parse_config",
    "parse_overrides",
]
