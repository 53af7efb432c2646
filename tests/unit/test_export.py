"""export / generate / eval: a node's checkpoint (and a pipeline's stage checkpoints) as a Hugging Face Llama.

The checkpoints are written as the peers write them (Trainer.save with the outer state in aux and the spec
in extra; capture_stage for a stage), from weights perturbed away from init so that a wrong mapping
(rotary rows, names, tied head, E_f) shows in the logits.
"""

import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner

from locomm.checkpoint import CHECKPOINT_NAME, SPEC_KEY, save_checkpoint
from locomm.cli.model_commands import eval_command, export, generate
from locomm.model import LlamaModel
from locomm.model.hf import build_model_from, load_weights, sample
from locomm.model.stages import ConstrainedModel
from locomm.peer.pipeline.checkpoint import capture_stage
from locomm.protocol import build_outer
from locomm.train import Trainer
from locomm.train.stage import StageWorker

transformers = pytest.importorskip("transformers")


@torch.no_grad()
def _perturb(params, gen, scale=0.1):
    for p in params:
        if p.ndim == 1:
            p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def _node_checkpoint(spec, splits, folder, *, with_spec=True):
    """A data-parallel node's checkpoint whose phi and local model differ; returns (phi, local) tensors."""
    spec = spec.replace("outer", algo="noloco")
    t = Trainer(spec, splits=splits)
    gen = torch.Generator().manual_seed(1)
    _perturb(t.model.parameters(), gen)
    algo = build_outer(spec.outer, dict(t.model.named_parameters()), 0)  # phi: this point
    _perturb(t.model.parameters(), gen, 0.05)  # the local model moved on
    extra = {"round": 3, **({} if with_spec else {SPEC_KEY: None})}  # None: as an older locomm wrote it
    t.save(folder, aux=algo.state_dict(), extra=extra)
    return spec, {k: v.clone() for k, v in algo.phi.items()}


def _hf(out):
    return transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()


def _reference(spec, tensors):
    m = LlamaModel(spec.model)
    m.load_state_dict(tensors, strict=False)  # tied head: embed.weight covers it
    return m.eval()


def _tokens(n=48, seed=0):
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def node(nano_spec, nano_splits, tmp_path_factory):
    folder = tmp_path_factory.mktemp("node")
    spec, phi = _node_checkpoint(nano_spec, nano_splits, folder)
    out = folder.parent / (folder.name + "-hf")
    result = CliRunner().invoke(export, ["--checkpoint-dir", str(folder), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "outer weights" in result.output
    return spec, phi, folder, out


def test_export_loads_in_transformers_with_the_same_logits(node):
    spec, phi, _, out = node
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["num_key_value_heads"] == spec.model.n_heads
    hf = _hf(out)
    x = _tokens()
    with torch.no_grad():
        ours, theirs = _reference(spec, phi)(x), hf(x).logits
    assert ours.shape == theirs.shape == (2, 48, spec.model.vocab_size)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    assert ours.std() > 0.1  # perturbed: a wrong mapping would show


def test_export_without_rotary_permutation_would_differ(node):
    """The permutation matters: HF's rotate_half on unpermuted rows gives other logits (the test can fail)."""
    spec, phi, _, out = node
    hf = _hf(out)
    with torch.no_grad():
        for layer in hf.model.layers:
            Dh = spec.model.d_model // spec.model.n_heads
            inv = torch.argsort(torch.cat((torch.arange(0, Dh, 2), torch.arange(1, Dh, 2))))
            w = layer.self_attn.q_proj.weight
            w.copy_(w.view(spec.model.n_heads, Dh, -1)[:, inv].reshape_as(w))
        x = _tokens()
        assert not torch.allclose(hf(x).logits, _reference(spec, phi)(x), atol=1e-3)


def test_greedy_generate_matches_transformers(node):
    spec, phi, folder, out = node
    prompt = list(b"def ")
    ours = sample(_reference(spec, phi), prompt, max_new=40, temperature=0)
    hf_out = _hf(out).generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
    theirs = [t for t in hf_out[0, len(prompt) :].tolist() if t != 257]
    assert ours == theirs[: len(ours)] and len(ours) > 0
    result = CliRunner().invoke(
        generate, ["--checkpoint-dir", str(folder), "--prompt", "def ", "--temperature", "0", "--max-bytes", "40"]
    )
    assert result.exit_code == 0, result.output
    expected = bytes(prompt + [t for t in ours if t < 256]).decode("utf-8", errors="replace")
    assert result.output == expected + "\n"


def test_sampling_is_seeded(node):
    _, _, folder, _ = node
    args = ["--checkpoint-dir", str(folder), "--prompt", "x", "--max-bytes", "30", "--top-k", "20"]
    a, b, c = (CliRunner().invoke(generate, [*args, "--seed", s]) for s in ("1", "1", "2"))
    assert a.exit_code == 0, a.output
    assert a.output == b.output and a.output != c.output


def test_tokenizer_is_the_byte_vocabulary(node):
    *_, out = node
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "déf x():\n\treturn 1 \x00"
    assert tok(text)["input_ids"] == list(text.encode())
    assert tok.decode(list(text.encode())) == text
    assert tok.eos_token_id == 257


def test_eval_prints_finite_loss(node):
    _, _, folder, _ = node
    result = CliRunner().invoke(eval_command, ["--checkpoint-dir", str(folder), "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.output.strip().splitlines()[-1])
    assert math.isfinite(got["val_loss"]) and got["val_loss"] > 0
    assert got["bits_per_byte"] == pytest.approx(got["val_loss"] / math.log(2))


def test_local_weights_and_a_checkpoint_without_spec(nano_spec, nano_splits, tmp_path):
    spec, phi = _node_checkpoint(nano_spec, nano_splits, tmp_path / "c", with_spec=False)
    no_spec = CliRunner().invoke(export, ["--checkpoint-dir", str(tmp_path / "c"), "--out", str(tmp_path / "o")])
    assert no_spec.exit_code == 2 and "carries no run spec" in no_spec.output
    spec.save(tmp_path / "spec.toml")
    args = ["--checkpoint-dir", str(tmp_path / "c"), "--config", str(tmp_path / "spec.toml")]
    ok = CliRunner().invoke(export, [*args, "--weights", "local", "--out", str(tmp_path / "o")])
    assert ok.exit_code == 0, ok.output and "local weights" in ok.output
    x = _tokens()
    with torch.no_grad():
        assert not torch.allclose(_hf(tmp_path / "o")(x).logits, _reference(spec, phi)(x), atol=1e-3)


@pytest.mark.parametrize("make", ["missing", "garbage", "empty"])
def test_bad_checkpoint_dir_is_one_line_exit_2(tmp_path, make):
    folder = tmp_path / "ck"
    if make != "missing":
        folder.mkdir()
    if make == "garbage":
        (folder / CHECKPOINT_NAME).write_bytes(b"not a checkpoint")
    for cmd, extra in ((export, ["--out", str(tmp_path / "o")]), (generate, []), (eval_command, [])):
        result = CliRunner().invoke(cmd, ["--checkpoint-dir", str(folder), *extra])
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: ") and result.output.count("\n") == 1


# -- pipeline stages ---------------------------------------------------------------------


def _stage_checkpoints(spec, root, project=True):
    """Every stage of one replica checkpointed as a stage peer does; returns the reference (unsplit) model."""
    workers = [StageWorker(spec, s) for s in range(spec.pipeline.stages)]
    gen = torch.Generator().manual_seed(2)
    phis = []
    for w in workers:
        _perturb(w.module.parameters(), gen)
        if project:  # off: writes outside span(U), which no exact Llama matches
            w.module.project_()
        algo = build_outer(spec.outer, w.params(), 0)
        phis.append({k: v.clone() for k, v in algo.phi.items()})
        _perturb(w.module.parameters(), gen, 0.05)
        w.module.project_()
        (root / f"stage{w.stage}").mkdir(parents=True)
        save_checkpoint(root / f"stage{w.stage}" / CHECKPOINT_NAME, capture_stage(w, algo, None, spec=spec, clock=0))
    for w, phi in zip(workers, phis):
        w.module.load_state_dict(phi, strict=False)
    return ConstrainedModel([w.module for w in workers]).eval()


@pytest.mark.parametrize("subspace", [True, False])
def test_pipeline_stages_export_as_the_unsplit_model(nano_spec, tmp_path, subspace):
    spec = nano_spec.replace("outer", algo="noloco").replace("pipeline", stages=2, subspace=subspace, branch_norm=False)
    reference = _stage_checkpoints(spec, tmp_path / "ck")
    result = CliRunner().invoke(export, ["--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert "outer weights of 2 pipeline stages" in result.output
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(_hf(tmp_path / "hf")(x).logits, reference(x), atol=1e-4, rtol=1e-4)


def test_generate_and_eval_run_a_pipeline_that_plain_llama_cannot(nano_spec, tmp_path):
    spec = nano_spec.replace("outer", algo="noloco").replace("pipeline", stages=2)  # subspace, branch_norm on
    reference = _stage_checkpoints(spec, tmp_path / "ck")
    w = load_weights([tmp_path / "ck"])
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(build_model_from(w)(x), reference(x), atol=1e-5, rtol=1e-5)
    args = ["--checkpoint-dir", str(tmp_path / "ck")]
    gen = CliRunner().invoke(generate, [*args, "--prompt", "def ", "--temperature", "0", "--max-bytes", "20"])
    assert gen.exit_code == 0, gen.output
    ours = sample(reference, list(b"def "), max_new=20, temperature=0)
    assert gen.output == bytes(list(b"def ") + [t for t in ours if t < 256]).decode(errors="replace") + "\n"
    js = CliRunner().invoke(generate, [*args, "--prompt", "def ", "--temperature", "0", "--max-bytes", "20", "--json"])
    out = json.loads(js.output.splitlines()[-1])
    assert js.exit_code == 0 and out["prompt"] == "def " and out["prompt"] + out["continuation"] + "\n" == gen.output
    ev = CliRunner().invoke(eval_command, [*args, "--device", "cpu", "--json"])
    assert ev.exit_code == 0 and math.isfinite(json.loads(ev.output.splitlines()[-1])["val_loss"]), ev.output


def test_pipeline_refusals(nano_spec, tmp_path):
    spec = nano_spec.replace("outer", algo="noloco").replace("pipeline", stages=2, branch_norm=False)
    _stage_checkpoints(spec, tmp_path / "a")
    _stage_checkpoints(spec.replace("inner", lr=1e-4), tmp_path / "b")
    _stage_checkpoints(spec.replace("pipeline", branch_norm=None), tmp_path / "c")  # subspace: branch_norm on
    _stage_checkpoints(spec, tmp_path / "d", project=False)
    (tmp_path / "replica").mkdir()
    shutil.copy(tmp_path / "a/stage0" / CHECKPOINT_NAME, tmp_path / "replica" / CHECKPOINT_NAME)

    def dirs(*names):
        return [a for n in names for a in ("--checkpoint-dir", str(tmp_path / n))]

    cases = {
        "no checkpoint of stage(s) [1]": dirs("a/stage0"),
        "different run specs": dirs("a/stage0", "b/stage1"),
        "two checkpoints of stage 0": dirs("a", "replica"),
        "branch_norm": dirs("c"),
        "layers.0.attn.wo.weight is not in the subspace": dirs("d"),
    }
    for message, args in cases.items():
        result = CliRunner().invoke(export, [*args, "--out", str(tmp_path / "o")])
        assert result.exit_code == 2 and message in result.output, (message, result.output)
        assert result.output.count("\n") == 1
