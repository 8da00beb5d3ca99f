"""``--task hf:PATH`` (a transformers causal LM from a local folder) and ``dtrain ckpt export --hf``.

Tier 1: folders and their mistakes, the data (byte-level and a folder's own tokenizer), the
decoder layers found, the tensor-parallel plan, export of a one-process checkpoint and loading
it back. The folders are built here from a config (save_pretrained): nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

try:
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
except Exception as err:  # not installed, or (CI's torch-2.13 smoke venv) its torchvision import fails
    pytest.skip(f"transformers cannot be imported here: {err}", allow_module_level=True)

import dtrain
from dtrain.checkpoint.hf_export import export
from dtrain.cli import main as cli_main
from dtrain.errors import CheckpointError, ConfigError
from dtrain.tasks import load_task
from dtrain.tasks.hf import CausalLM

TINY = {"context": "32", "max_bytes": "40000"}


def llama_config(**kw) -> LlamaConfig:
    sizes = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    return LlamaConfig(**{**sizes, **kw})


def gpt2_config(**kw) -> GPT2Config:
    # no dropout: its random masks differ between one process and two ranks (parity tests)
    sizes = dict(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2Config(**{**sizes, **kw})


def folder(path, config, weights: bool = False) -> str:
    """A model folder as save_pretrained writes it: config.json, and model.safetensors if ``weights``."""
    path.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(1)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    else:
        config.save_pretrained(str(path))
    return str(path)


@pytest.fixture
def llama(tmp_path) -> str:
    return folder(tmp_path / "llama", llama_config())


@pytest.fixture
def gpt2(tmp_path) -> str:
    return folder(tmp_path / "gpt2", gpt2_config())


# -- folders and their mistakes -------------------------------------------------------------------
def test_missing_folder_and_hub_name_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"no folder .*nope; give a folder with config.json"):
        load_task(f"hf:{tmp_path}/nope")
    with pytest.raises(ConfigError, match=r"no folder meta-llama/Llama-3.2-1B here, and dtrain never downloads a model"):
        load_task("hf:meta-llama/Llama-3.2-1B")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        load_task(f"hf:{tmp_path / 'empty'}")


def test_a_config_transformers_does_not_know_is_one_line(tmp_path):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "no-such-model", "hidden_size": 8}')
    with pytest.raises(ConfigError, match=r"transformers 5\.\S+ cannot read .*config.json"):
        load_task(f"hf:{tmp_path / 'odd'}")


def test_a_vocabulary_smaller_than_bytes_without_a_tokenizer_is_one_line(tmp_path):
    path = folder(tmp_path / "small", llama_config(vocab_size=100))
    with pytest.raises(ConfigError, match=r"vocab_size=100 is smaller than the 256 byte values .* no tokenizer"):
        load_task(f"hf:{path}", options=TINY)


def test_context_longer_than_the_model_is_one_line(llama):
    with pytest.raises(ConfigError, match=r"context=100 is longer than the model's 64 positions"):
        load_task(f"hf:{llama}", options={"context": "100"})


def test_init_from_needs_an_hf_task_and_a_folder_with_weights(tmp_path, llama, capsys):
    assert cli_main(["train", "--task", "lm", "--init-from", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dtrain: error: --init-from {tmp_path} needs --task hf:PATH"), lines
    with pytest.raises(ConfigError, match="has no model.safetensors"):
        load_task(f"hf:{llama}", options={**TINY, "init_from": llama})


# -- the task -------------------------------------------------------------------------------------
def test_byte_level_windows_and_the_decoder_layers(llama, gpt2):
    for path, layer in ((llama, "LlamaDecoderLayer"), (gpt2, "GPT2Block")):
        task = load_task(f"hf:{path}", options=TINY)
        x, y = task.train_set[3]
        assert x.dtype == torch.long and torch.equal(x[1:], y[:-1]) and int(x.max()) < 256
        model = task.new_model()
        assert isinstance(model, CausalLM) and model(x[None]).shape == (1, 32, 256)
        blocks = task.blocks(model)
        assert [type(b).__name__ for b in blocks] == [layer, layer]
        assert task.tokens_per_sample == 32 and task.metric_name == "val_loss"


def test_the_folders_tokenizer_tokenises_the_corpus(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = "def add(a, b):\n    return a + b\n" * 50
    (tmp_path / "corpus.txt").write_text(text * 40)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    path = folder(tmp_path / "tok", llama_config(vocab_size=400))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    task = load_task(f"hf:{path}", data_dir=str(tmp_path / "corpus.txt"), options={"context": "16"})
    x, _ = task.train_set[0]
    expected = tok.encode(text).ids[:16]
    assert x.tolist() == expected and expected != list(text.encode()[:16])  # merged tokens, not bytes
    small = folder(tmp_path / "small", llama_config(vocab_size=8))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(small)
    with pytest.raises(ConfigError, match=r"token id \d+, beyond the model's vocab_size=8"):
        load_task(f"hf:{small}", data_dir=str(tmp_path / "corpus.txt"), options={"context": "16"})


def test_weights_of_the_folder_are_loaded(tmp_path):
    path = folder(tmp_path / "w", llama_config(), weights=True)
    saved = AutoModelForCausalLM.from_pretrained(path)
    model = load_task(f"hf:{path}", options=TINY).new_model()
    for name, p in saved.state_dict().items():
        assert torch.equal(model.hf.state_dict()[name], p), name


def test_tp_plan_splits_llama_layers_and_says_why_not_elsewhere(llama, gpt2):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    task = load_task(f"hf:{llama}", options=TINY)
    plan = task.tp_plan(task.new_model(), 2)
    assert len(plan) == 2 * 7
    assert isinstance(plan["hf.model.layers.1.self_attn.k_proj"], ColwiseParallel)
    assert isinstance(plan["hf.model.layers.0.mlp.down_proj"], RowwiseParallel)
    with pytest.raises(ConfigError, match="num_key_value_heads=2, which 4 ranks cannot split"):
        task.tp_plan(task.new_model(), 4)
    g = load_task(f"hf:{gpt2}", options=TINY)
    with pytest.raises(ConfigError, match="no tensor-parallel plan for hf model gpt2"):
        g.tp_plan(g.new_model(), 2)


# -- export and init-from (one process) -----------------------------------------------------------
def _trained_checkpoint(path: str, ckpt_dir) -> CausalLM:
    """Two AdamW steps of the task in one process, saved; returns the trained model."""
    task = load_task(f"hf:{path}", options=TINY)
    ctx = dtrain.init("single", seed=0)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = ctx.setup(model, opt, blocks=task.blocks(model))
    for i in range(2):
        x, y = task.train_set[i]
        ctx.forward_backward(model, x[None], y[None], task.loss_fn)
        opt.step()
        opt.zero_grad()
    ctx.checkpoints(str(ckpt_dir)).save(2, model=model, optimizer=opt)
    trained = ctx.unwrap(model)
    ctx.close()
    return trained


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, kind):
    path = folder(tmp_path / kind, llama_config() if kind == "llama" else gpt2_config())
    model = _trained_checkpoint(path, tmp_path / "ckpt")
    out = tmp_path / "export"
    assert cli_main(["ckpt", "export", str(tmp_path / "ckpt"), "--hf", str(out), "--config", path]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(x), loaded(x).logits
        fresh = load_task(f"hf:{path}", options=TINY).new_model().eval()(x)
    assert (ours - theirs).abs().max().item() <= 1e-6
    assert (ours - fresh).abs().max().item() > 1e-3  # trained weights, not the config's random init
    # --init-from reads it back into a fresh model of the config (after setup: here unsplit)
    task = load_task(f"hf:{path}", options={**TINY, "init_from": str(out)})
    again = task.new_model().eval()
    task.load_weights(again)
    with torch.no_grad():
        assert torch.equal(again(x), theirs)


def reads_of(patch) -> list[tuple[str, int]]:
    """Every tensor read through safetensors' ``safe_open`` from now on: (name, bytes).
    ``patch``: ``monkeypatch.setattr``, or ``setattr`` in a rank's own process."""
    import safetensors

    reads: list[tuple[str, int]] = []
    real = safetensors.safe_open

    class Slice:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def __getitem__(self, index):
            t = self.inner[index]
            reads.append((self.name, t.numel() * t.element_size()))
            return t

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

    class Handle:
        def __init__(self, *args, **kw):
            self.inner = real(*args, **kw)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, name):
            return Slice(self.inner.get_slice(name), name)

        def get_tensor(self, name):
            t = self.inner.get_tensor(name)
            reads.append((name, t.numel() * t.element_size()))
            return t

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

    patch(safetensors, "safe_open", Handle)
    return reads


@pytest.mark.parametrize("tied, shard", [(False, None), (True, "20KB")])
def test_init_from_unsplit_reads_every_tensor_once_and_equals_the_folder(tmp_path, monkeypatch, tied, shard):
    from safetensors.torch import load_file

    config = llama_config(tie_word_embeddings=tied)
    src = tmp_path / "w"
    torch.manual_seed(1)
    kw = {"max_shard_size": shard} if shard else {}
    AutoModelForCausalLM.from_config(config).save_pretrained(str(src), **kw)  # tied: the head is saved once
    files = sorted(src.glob("*.safetensors"))
    assert (len(files) == 1) == (shard is None), files  # 20KB: several files and an index
    saved = {k: v for f in files for k, v in load_file(str(f)).items()}
    path = folder(tmp_path / "cfg", config)
    task = load_task(f"hf:{path}", options={**TINY, "init_from": str(src)})
    model = task.new_model()
    reads = reads_of(monkeypatch.setattr)
    task.load_weights(model)
    assert sorted(n for n, _ in reads) == sorted(saved)  # each tensor once (a tied one too)
    assert sum(b for _, b in reads) == sum(v.numel() * v.element_size() for v in saved.values())
    own = model.hf.state_dict()
    for name, value in saved.items():
        assert torch.equal(own[name], value), name
    if tied:
        assert "lm_head.weight" not in saved and model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    assert model.init_from == ""  # read once
    task.load_weights(model)
    assert len(reads) == len(saved)


def test_init_from_weights_of_another_shape_is_one_line(tmp_path, llama):
    wider = folder(tmp_path / "wider", llama_config(hidden_size=64), weights=True)
    task = load_task(f"hf:{llama}", options={**TINY, "init_from": wider})
    with pytest.raises(CheckpointError, match=r"--init-from .*wider: the weights of .* do not fit the model of the config "
                                              r"\(\S+ is \(256, 64\), the model's \(256, 32\); 0 missing, 0 unexpected, 21 of another shape\)"):
        task.load_weights(task.new_model())
    assert load_task(f"hf:{llama}", options=TINY).load_weights is None


def test_export_refuses_an_existing_target_and_a_checkpoint_of_another_task(tmp_path, llama):
    _trained_checkpoint(llama, tmp_path / "ckpt")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="exists already; give a new folder"):
        export(str(tmp_path / "ckpt"), llama, str(tmp_path / "taken"))
    with pytest.raises(ConfigError, match="is a file"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "ckpt" / "latest"), str(tmp_path / "out"))
    other = folder(tmp_path / "wider", llama_config(hidden_size=64))
    with pytest.raises(CheckpointError, match="do not fit the model of the config"):
        export(str(tmp_path / "ckpt"), other, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.exporting").exists()


def test_pipeline_stages_are_refused_in_one_line(llama):
    from dtrain.parallel.pipeline import PipelineConfig, split_stage

    task = load_task(f"hf:{llama}", options=TINY)
    model = task.new_model()
    with pytest.raises(ConfigError, match=r"not an nn.Sequential.*Hugging Face model, --task hf:PATH, cannot be cut yet"):
        split_stage(model, 0, 2, PipelineConfig(), task.blocks(model))


def test_activation_checkpointing_of_the_decoder_layers_gives_the_same_losses(llama):
    def losses(ac: bool) -> tuple[list[float], int]:
        task = load_task(f"hf:{llama}", options=TINY)
        ctx = dtrain.init("single", seed=0, activation_checkpointing=ac)
        model = task.build_model()
        blocks = task.blocks(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = ctx.setup(model, opt, blocks=blocks)
        out = []
        for i in range(3):
            x, y = task.train_set[i]
            out.append(ctx.forward_backward(model, x[None], y[None], task.loss_fn).item())
            opt.step()
            opt.zero_grad()
        ctx.close()
        return out, sum(getattr(b, "_dtrain_checkpointed", False) for b in blocks)

    (plain, none), (recomputed, both) = losses(False), losses(True)
    assert (none, both) == (0, 2)  # both decoder layers recompute in backward
    assert recomputed == plain  # the same operations on the same inputs: bit for bit on CPU
