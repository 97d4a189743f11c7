import subprocess
import sys
from typing import get_args

import pytest
import tomllib

from fedmitr_core.config import (
    ConfigError,
    MethodName,
    ModelName,
    OneShotMethod,
    default_flat_config,
    parse_config,
    parse_overrides,
)


def test_pyproject_defaults_equal_core_defaults(repo_root):
    with open(repo_root / "pyproject.toml", "rb") as fh:
        app_config = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    assert app_config == default_flat_config()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"alpha": -1}, "'alpha'"),
        ({"dataset": "mnist-typo"}, "'dataset'"),
        ({"methods": "fedmitr,nope"}, "'methods'"),
        ({"patch-size": 5}, "'patch-size'"),
        ({"keep-ratio": 0.0}, "'keep-ratio'"),
        ({"local-epochs": 2.5}, "'local-epochs'"),
        ({"prune-at": "0.1,1.5"}, "'prune-at'"),
        ({"weighting": "median"}, "'weighting'"),
        ({"preset": "does-not-exist"}, "'preset'"),
        ({"alhpa": 0.3}, "'alhpa'"),
        ({"methods": "fedavg-rounds,fedmitr"}, "'methods'"),
        ({"num-rounds": 1}, "'num-rounds'"),
        ({"teachers-per-class": -1}, "'teachers-per-class'"),
        ({"precision": "fp8"}, "'precision'"),
        ({"gen-rounds": 0}, "'gen-rounds'"),
        ({"coboost-mu-decay": 1.5}, "'coboost-mu-decay'"),
        ({"dense-temperature": 0}, "'dense-temperature'"),
        ({"fedftg-div": -1}, "'fedftg-div'"),
        ({"fedftg-lr": 0}, "'fedftg-lr'"),
    ],
)
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        parse_config(overrides)
    assert key in str(err.value)


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match="did you mean 'alpha'"):
        parse_config({"alhpa": 0.3})


def test_types_are_cast_and_methods_split():
    cfg = parse_config({"methods": "deepinversion, fedmitr", "prune-at": "0.25,0.5",
                        "alpha": 1, "download": "true"})
    assert cfg.server.methods == ("deepinversion", "fedmitr")
    assert cfg.inversion.prune_at == (0.25, 0.5)
    assert isinstance(cfg.partition.alpha, float) and cfg.partition.alpha == 1.0
    assert cfg.data.download is True


def test_a_bare_integer_for_a_text_key_is_its_text():
    assert parse_config({"feature-stats-layers": 0}).prior.feature_stats_layers == "0"
    with pytest.raises(ConfigError, match="'run-name': expected a string"):
        parse_config({"run-name": True})
    with pytest.raises(ConfigError, match="'feature-stats-layers'"):
        parse_config({"feature-stats-layers": 1.5})


def test_preset_overrides_defaults_and_explicit_keys_override_preset():
    assert parse_config({"preset": "digits-alpha01"}).partition.alpha == 0.1
    cfg = parse_config({"preset": "digits-alpha01", "alpha": 0.3})
    assert cfg.partition.alpha == 0.3
    # Flower merges defaults and explicit keys: a value equal to the default
    # cannot be told from it, so the preset wins (documented).
    assert parse_config({"preset": "digits-alpha01", "alpha": 0.5}).partition.alpha == 0.1


def test_preset_with_unknown_key_is_refused(tmp_path):
    (tmp_path / "bad.yaml").write_text("run-config:\n  alpah: 0.1\n")
    with pytest.raises(ConfigError, match="alpah"):
        parse_config({"preset": "bad"}, presets_dir=tmp_path)


def test_flat_round_trip():
    cfg = parse_config({"alpha": 0.1, "methods": "fedmitr"})
    again = parse_config({k: v for k, v in cfg.to_flat().items()})
    assert again == cfg


def test_model_and_method_names_equal_the_registries():
    from fedmitr_core.methods import METHODS, ROUND_METHODS
    from fedmitr_core.models.vit import MODEL_PRESETS

    assert set(get_args(ModelName)) == set(MODEL_PRESETS)
    assert set(get_args(OneShotMethod)) == set(METHODS)
    assert set(get_args(MethodName)) == set(METHODS) | ROUND_METHODS


def test_validating_a_config_imports_nothing_of_the_core_nor_torch():
    code = ("import sys; from fedmitr_core.config import parse_config; "
            "parse_config({'methods': 'fedmitr,dense', 'model': 'vit-tiny'}); "
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'timm', "
            "'fedmitr_core.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "['fedmitr_core.config']"


def test_bad_model_and_method_names_list_the_choices():
    with pytest.raises(ConfigError, match="'model'.*vit-micro"):
        parse_config({"model": "vit-huge"})
    with pytest.raises(ConfigError, match="'methods'.*coboosting"):
        parse_config({"methods": "fedmitr,co-boosting"})


def test_resume_from_needs_a_run_folder_with_uploads(tmp_path):
    with pytest.raises(ConfigError, match="'resume-from'"):
        parse_config({"resume-from": str(tmp_path / "nowhere")})
    (tmp_path / "run" / "uploads").mkdir(parents=True)
    assert parse_config({"resume-from": str(tmp_path / "run")}).server.resume_from


def test_checkpoint_every_must_not_be_negative():
    with pytest.raises(ConfigError, match="'checkpoint-every'"):
        parse_config({"checkpoint-every": -1})


def test_command_line_overrides_read_yaml_and_an_empty_value_is_the_empty_string():
    overrides = parse_overrides(["prune-at=", "alpha=0.1", "methods=fedmitr,dense"], "--set")
    assert overrides == {"prune-at": "", "alpha": 0.1, "methods": "fedmitr,dense"}
    assert parse_config(overrides).inversion.prune_at == ()
    with pytest.raises(ConfigError, match="'alpha0.1': expected key=value"):
        parse_overrides(["alpha0.1"], "--set")
