import pytest
import tomllib
from conftest import ROOT

from fedmitr_core.config import ConfigError, default_flat_config, parse_config


def test_pyproject_defaults_equal_core_defaults():
    with open(ROOT / "pyproject.toml", "rb") as fh:
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
