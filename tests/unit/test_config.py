import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from locomm.config import ConfigError, ModelConfig, OuterConfig, RunSpec


def test_toml_round_trip_and_stable_hash(tmp_path):
    spec = RunSpec.preset("nano").replace("outer", algo="noloco", inner_steps=20)
    path = tmp_path / "run.toml"
    spec.save(path)
    again = RunSpec.load(path)
    assert again == spec
    assert again.hash() == spec.hash()
    assert len(spec.hash()) == 64


def test_hash_changes_with_any_field():
    base = RunSpec.preset("nano")
    assert base.replace("outer", lr=0.5).hash() != base.hash()
    assert base.replace("data", seq_len=64).hash() != base.hash()
    assert RunSpec.preset("nano").hash() == base.hash()


def test_partial_toml_uses_preset_defaults():
    spec = RunSpec.from_toml('[model]\npreset = "nano"\n[outer]\nalgo = "noloco"\n')
    assert spec.model.d_model == 64 and spec.outer.algo == "noloco"
    assert spec.train.steps == RunSpec.preset("nano").train.steps


@pytest.mark.parametrize(
    "toml, field",
    [
        ("[outer]\ngroup_size = 1", "outer.group_size"),
        ("[outer]\ninner_steps = 0", "outer.inner_steps"),
        ('[outer]\nalgo = "allreduce"', "outer.algo"),
        ("[model]\nd_model = 65", "model.d_model"),
        ('[model]\npreset = "huge"', "model.preset"),
        ("[inner]\nlr = -1.0", "inner.lr"),
        ('[inner]\nlr = "fast"', "inner.lr"),
        ("[data]\nseq_len = 100000", "data.seq_len"),
        ("[train]\nsteps = 1.5", "train.steps"),
        ("[outer]\nbogus = 1", "outer.bogus"),
        ("[model]\nn_layers = true", "model.n_layers"),
        ("[inner]\nlr = inf", "inner.lr"),
        ('[pipeline]\nlayers = [1, "a"]', r"pipeline.layers[1]"),
        ("[nonsense]\nx = 1", "nonsense"),
        ("not toml [", "invalid TOML"),
    ],
)
def test_invalid_values_name_the_field(toml, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        RunSpec.from_toml(toml)


def test_an_error_in_a_file_names_its_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "nano"\n\n[outer]\nalgo = "noloco"\nlr = "fast"\n')
    with pytest.raises(
        ConfigError, match=re.escape(f"outer.lr: input should be a valid number, got 'fast' ({path}, line 6)")
    ):
        RunSpec.load(path)
    path.write_text("[data]\nseq_len = 100000\n")  # a relation between sections, checked by the spec
    with pytest.raises(
        ConfigError, match=re.escape(f"data.seq_len: 100000 exceeds model.max_seq_len=256 ({path}, line 2)")
    ):
        RunSpec.load(path)


# sha256 of every shipped config (benchmarks/configs, compose) and preset, taken before the spec moved to
# pydantic and tomli-w: a change of parser or writer must not change what peers agree on (edit a hash here
# only with the config it names).
SHIPPED = {
    "configs/chaos-5m.toml": "6c8d839fa8500d272959a2d5a2d6febd7e71866c1d4d9f4c9efeea94c62076e2",
    "configs/chaos-nano.toml": "f6ccfb102fcb2d4eead6384177630e3bda72163649a517e9dc3fbc8c05168101",
    "configs/links-56m-short.toml": "234c63032f58cf4aff2bcd5b660ca75379f9851b511effe776152b5012e5d31e",
    "configs/links-56m.toml": "89b2ffc00bcd7a16c4b1f44461a64c87209986df60e032ee13a76c75047b3dd8",
    "configs/links-island.toml": "4e1301f8b47778357e5717c355adf6b60108497f0761f3df3069186537b667d7",
    "configs/links-nano-nat.toml": "1e88439c62addba01bdbda0be5c6578479bcf288ca0c6cc622d4ef3ce796ae62",
    "configs/links-nano.toml": "52a7a9512e23e855474e0a32c16e50c5772f87cee4adc69b46f24f4ec3e8eaa2",
    "configs/links-pipeline-tiny.toml": "74037e5f205678d4c43941df3e7643c71b2b23b53bfa670921c3e79b5be6e6fc",
    "configs/pause-3m.toml": "f29cb32a8f62077a4843df6cad3f390e61ab30b061c3474c6d175f1cf31f751b",
    "configs/pipeline-tiny-consumer-16.toml": "d85f2b003d07623e4a69c01993b7fc658b3fee3fc5d7e2d11be32d4e0775784e",
    "configs/pipeline-tiny-consumer.toml": "85c105f4b418e5a64a4c9a67c2dc79add43a26be3449622a08fb9aa7fab58260",
    "configs/pipeline_nano.toml": "19d821d1c67d8d4f9919e680ca83b299e163aae7a42941b97bbd7e8c4a10dbb5",
    "configs/pipeline_nano4.toml": "15ba96ffc6837ec28d2c5e54b291fad02de0ef32070538c1e73f552607fd33b7",
    "compose/run.toml": "7aeb771b49cac6f3bdbf9216acde8dd615e446eef10652a96fb31a3f1041cdf7",
    "preset:nano": "d0bd9fedb7ef751e29febcb56c310df40b7e97df1419688df44d764dcb16a35e",
    "preset:tiny": "6f0175e02e0f41ee3398b5b9fca0aebfc95bd63066865b017a13a5838d7b5b3b",
    "preset:small": "776a654762955cd0f2767465c72c899540c69d43c6d44288ded52ccf8a7e518d",
    "preset:base": "69f3184854140d7884aa5423448a7743a2d5d309e852597a37d3ca5911b9c449",
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_keep_their_hash_through_a_round_trip(name):
    root = Path(__file__).resolve().parents[2]
    path = root / ("benchmarks/" + name if name.startswith("configs/") else name)
    spec = RunSpec.preset(name[7:]) if name.startswith("preset:") else RunSpec.load(path)
    again = RunSpec.from_toml(spec.to_toml())
    assert spec.hash() == SHIPPED[name] and again == spec and again.hash() == SHIPPED[name]


def test_every_shipped_config_is_in_the_hash_table():
    root = Path(__file__).resolve().parents[2]
    shipped = {f"configs/{p.name}" for p in (root / "benchmarks/configs").glob("*.toml")}
    shipped |= {f"compose/{p.name}" for p in (root / "compose").glob("*.toml")}
    assert shipped == {k for k in SHIPPED if not k.startswith("preset:")}


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="n_heads"):
        ModelConfig(d_model=64, n_heads=64)  # head size 1 is odd: no rotary pairs
    with pytest.raises(ConfigError, match="participation"):
        OuterConfig(participation=0.0)
    with pytest.raises(ConfigError, match="missing.toml"):
        RunSpec.load("missing.toml")


def test_config_and_help_do_not_import_torch():
    code = "import sys, locomm.config, locomm.cli.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "locomm.cli.main", "--help"], capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    assert out.returncode == 0 and "train" in out.stdout
    assert elapsed < 3.0  # well under a second on an idle machine; generous for loaded CI


def test_apply_delay_steps_is_bounded_by_h():
    from locomm.config import ConfigError, OuterConfig

    assert OuterConfig(inner_steps=20, apply_delay_steps=5).apply_delay_steps == 5
    with pytest.raises(ConfigError, match="apply_delay_steps"):
        OuterConfig(inner_steps=20, apply_delay_steps=21)


def test_a_field_added_later_is_neither_hashed_nor_written_at_its_default():
    """``inner.bias_correction`` came after runs had started: at its default a spec hashes and writes as before
    (a peer of the version before reads it and joins the same run); set off it, the run is another one."""
    from locomm.config.spec import RunSpec

    spec = RunSpec.preset("nano").replace("inner", name="adams")
    assert "bias_correction" not in spec.to_toml()
    off = spec.replace("inner", bias_correction=False)
    assert "bias_correction = false" in off.to_toml() and off.hash() != spec.hash()
    assert RunSpec.from_toml(off.to_toml()) == off and RunSpec.from_toml(spec.to_toml()) == spec
    with pytest.raises(ConfigError, match="bias_correction: only adams"):
        RunSpec.preset("nano").replace("inner", bias_correction=False)
