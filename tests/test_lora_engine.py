"""Multi-LoRA in the engine (`engine.weights.lora`, `engine.runners.lora_step`): adapters built here with
`peft` (non-zero B) and saved as PEFT folders, served by the paged runner, against PEFT's own
merged model (``merge_and_unload``); mixed steps (base + adapters) against each member alone;
the prefix cache keyed by adapter; bad folders refused.

A tiny random Llama-shaped model (GQA) for the fast tests; SmolLM2-135M (marked ``model``) in
float32 dense, float32 q4 (its weights are exact 4-bit blocks, so q4 computes with them) and
bfloat16 (compared as `test_dtype` compares bf16 with fp32: a token may differ only where the
reference itself was a close call)."""

from __future__ import annotations

import copy
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

peft = pytest.importorskip("peft")

from actorserve.engine.scheduling.block_manager import BlockManager
from actorserve.engine.weights.lora import (LoraError, LoraFolderError, LoraInUse, LoraNotLoaded, LoraSlotsFull,
                                    read_adapter)
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.engine.runners.runner import PagedLlamaRunner
from actorserve.engine.scheduling.sequence import Sequence

from engine_driver import Driver, RecordingGreedy

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, LoraConfig fields): every module; attention only with rsLoRA; the MLP and o_proj
ADAPTERS = [("all", dict(r=8, lora_alpha=16, target_modules=ALL)),
            ("qv_rs", dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"])),
            ("mlp_o", dict(r=2, lora_alpha=4, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]))]
PROMPTS = [[1, 215, 36, 60, 285, 142, 61, 175, 254, 272, 17, 39, 23],      # 13 tokens
           [1, 22, 4],
           [1, 5, 13, 127, 16, 28, 11, 29, 13, 287, 51, 30, 52, 5, 50, 47, 64, 30, 13, 28, 60, 16, 28, 11, 7]]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                         max_position_embeddings=256, rope_theta=5000.0))
    with torch.no_grad():      # the default init is near-uniform; spread the logits apart
        model.lm_head.weight.normal_(0, 1.0)
    return model.eval()


def build_adapter(base, folder, seed: int, b_std: float, **fields):
    """Save a PEFT LoRA adapter of `base` (untouched) with random A and B into `folder`;
    return PEFT's merged model of it."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(lora_dropout=0.0, **fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:           # PEFT starts B at zero: the adapter would change nothing
                p.normal_(0, b_std)
            elif "lora_A" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(folder))
    return model.merge_and_unload().eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tiny_llama()
    root = tmp_path_factory.mktemp("lora_tiny")
    merged = {}
    for i, (name, fields) in enumerate(ADAPTERS):
        merged[name] = build_adapter(base, root / name, seed=10 + i, b_std=0.2, **fields)
    return base, root, merged


def engine_for(base, root, *, num_blocks=96, block_size=4, **kw):
    eng = PagedLlamaRunner(copy.deepcopy(base), num_blocks=num_blocks, block_size=block_size,
                           sampler=RecordingGreedy(), **kw)
    refs = {name: eng.lora.load(name, root / name) for name, _ in ADAPTERS}
    return Driver(eng, BlockManager(num_blocks, block_size)), refs


def new(d: Driver, rid: str, prompt: list[int], adapter: str | None) -> Sequence:
    lora = None if adapter is None else d.engine.lora.acquire(adapter)
    seq = Sequence(rid, prompt, sampling=SamplingParams(temperature=0.0), lora=lora)
    d.bm.match_prefix(seq)
    return seq


# -- reading folders ----------------------------------------------------------------------------
def test_an_adapter_is_read_as_peft_saved_it(tiny):
    base, root, _ = tiny
    eng = PagedLlamaRunner(copy.deepcopy(base), num_blocks=8, block_size=4)
    ad = read_adapter("qv_rs", root / "qv_rs", eng.lora.shapes, max_rank=64)
    assert (ad.rank, ad.alpha, ad.modules) == (4, 8.0, ("q_proj", "v_proj"))
    assert ad.scaling == pytest.approx(8 / 2)                    # rsLoRA: alpha / sqrt(r)
    assert sorted(ad.weights) == [(li, m) for li in (0, 1) for m in ("q_proj", "v_proj")]
    from safetensors.torch import load_file
    saved = load_file(str(root / "qv_rs" / "adapter_model.safetensors"))
    a, b = ad.weights[(1, "v_proj")]
    assert torch.equal(a, saved["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"])
    assert torch.allclose(b, saved["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] * 4.0)
    assert a.shape == (4, 64) and b.shape == (16, 4) and b.abs().sum() > 0      # GQA: v is 2 heads
    other = read_adapter("same", root / "qv_rs", eng.lora.shapes, max_rank=64)
    assert other.key == ad.key and other.weights[(0, "q_proj")][0].dtype == torch.float32
    assert read_adapter("x", root / "all", eng.lora.shapes, max_rank=64).key != ad.key


# -- greedy output against PEFT's merged model ---------------------------------------------------
def test_each_adapter_decodes_as_pefts_merged_model(tiny):
    base, root, merged = tiny
    d, _ = engine_for(base, root)
    for name, _ in ADAPTERS:
        got = d.run([new(d, f"{name}{i}", p, name) for i, p in enumerate(PROMPTS)], 10)
        want = [hf_greedy(merged[name], p, 10) for p in PROMPTS]
        assert got == want, name
        assert want != [hf_greedy(base, p, 10) for p in PROMPTS]       # the adapter changes the output
    got = d.run([new(d, f"base{i}", p, None) for i, p in enumerate(PROMPTS)], 10)
    assert got == [hf_greedy(base, p, 10) for p in PROMPTS]
    assert d.bm.stats().used_blocks == 0


def test_a_step_mixing_the_base_and_three_adapters_gives_each_what_it_gets_alone(tiny):
    base, root, _ = tiny
    members = [(None, PROMPTS[0]), ("all", PROMPTS[0]), ("qv_rs", PROMPTS[2]), ("mlp_o", PROMPTS[1]),
               ("all", PROMPTS[2])]                 # "all" twice: its rows are two runs of the step
    alone = []
    for i, (ad, p) in enumerate(members):
        d, _ = engine_for(base, root)
        alone.append(d.run([new(d, f"a{i}", p, ad)], 12)[0])
    for chunk in (None, 5):                         # whole prompts, then prefill chunks beside decodes
        d, _ = engine_for(base, root)
        seqs = [new(d, f"m{i}", p, ad) for i, (ad, p) in enumerate(members)]
        rec = d.engine.sampler
        assert d.run(seqs, 12, chunk=chunk) == alone, chunk
        assert len(rec.logits["m0"]) == 12
    assert len({tuple(t) for t in alone[:2]}) == 2    # the base and "all" differ on the same prompt


def test_the_torch_path_without_the_c_kernel_gives_the_same_tokens(tiny, monkeypatch):
    """Without a C compiler the deltas are grouped torch products (`lora_step`): the same tokens."""
    from actorserve.engine.kernels import lora_kernel
    from actorserve.engine.runners import lora_step

    base, root, _ = tiny
    members = [(None, PROMPTS[0]), ("all", PROMPTS[0]), ("qv_rs", PROMPTS[2]), ("mlp_o", PROMPTS[1])]
    d, _ = engine_for(base, root)
    assert lora_step.Combo([d.engine.lora.adapter("all")]).table is not None
    with_c = d.run([new(d, f"c{i}", p, ad) for i, (ad, p) in enumerate(members)], 8)
    monkeypatch.setattr(lora_kernel, "_fn", [None])
    d, _ = engine_for(base, root)
    assert lora_step.Combo([d.engine.lora.adapter("all")]).table is None
    assert d.run([new(d, f"t{i}", p, ad) for i, (ad, p) in enumerate(members)], 8) == with_c


def test_speculative_verify_rows_take_the_adapter(tiny):
    """A member verifying drafts computes several rows in a step: all of them get its deltas."""
    base, root, merged = tiny
    d, _ = engine_for(base, root)
    want = hf_greedy(merged["all"], PROMPTS[0], 8)
    seq = new(d, "s", PROMPTS[0], "all")
    other = new(d, "b", PROMPTS[1], None)
    d.step([(seq, seq.num_uncomputed), (other, other.num_uncomputed)])
    seq.draft = want[1:4]                          # the right drafts: all accepted
    d.bm.allocate(seq, 4)
    outs = d.engine.execute([(seq, 4), (other, 1)])
    assert [outs[0].token_id] + [o.token_id for o in outs[0].extra] == want[1:5]


# -- the prefix cache is keyed by adapter -------------------------------------------------------
def test_kv_is_never_shared_across_adapters_or_with_the_base(tiny):
    base, root, merged = tiny
    d, refs = engine_for(base, root)
    prompt = PROMPTS[2]                                   # 25 tokens: 6 full blocks of 4
    first = new(d, "a1", prompt, "all")
    assert first.num_cached == 0
    d.run([first], 4)
    for rid, ad in (("b1", "qv_rs"), ("base1", None)):
        seq = new(d, rid, prompt, ad)
        assert seq.num_cached == 0, ad                    # the same tokens, another model: no hit
        d.run([seq], 4)
    again = new(d, "a2", prompt, "all")
    assert again.num_cached == 24                         # the same adapter: its own blocks
    assert d.run([again], 4) == [hf_greedy(merged["all"], prompt, 4)]
    base_again = new(d, "base2", prompt, None)
    assert base_again.num_cached == 24
    assert d.run([base_again], 4) == [hf_greedy(base, prompt, 4)]
    # the salt is the adapter's weights, not its name: the same folder under another name shares
    d.engine.lora.load("all_again", root / "all")
    twin = new(d, "twin", prompt, "all_again")
    assert twin.num_cached == 24 and twin.lora.key == refs["all"].key and twin.lora.slot != refs["all"].slot


# -- slots ---------------------------------------------------------------------------------------
def test_slots_load_unload_hold_and_refuse(tiny):
    base, root, _ = tiny
    eng = PagedLlamaRunner(copy.deepcopy(base), num_blocks=32, block_size=4, sampler=RecordingGreedy(),
                           max_loaded_loras=2)
    slots = eng.lora
    a = slots.load("a", root / "all")
    b = slots.load("b", root / "qv_rs")
    assert (a.slot, b.slot) == (0, 1) and a.uid != b.uid and slots.loaded() == [a, b]
    with pytest.raises(LoraSlotsFull, match="max_loaded_loras"):
        slots.load("c", root / "mlp_o")
    with pytest.raises(LoraError, match="already loaded"):
        slots.load("a", root / "mlp_o")
    held = slots.acquire("a")
    assert held == a and slots.holders("a") == 1
    with pytest.raises(LoraInUse, match="1 sequence"):
        slots.unload("a")
    slots.release(held)
    assert slots.unload("a") == a and slots.get("a") is None
    with pytest.raises(LoraNotLoaded):
        slots.unload("a")
    with pytest.raises(LoraNotLoaded):
        slots.acquire("a")
    c = slots.load("c", root / "mlp_o")
    assert c.slot == a.slot and c.uid != a.uid            # the freed slot, a new load
    # a sequence still naming the unloaded adapter fails its step instead of running under "c"
    d = Driver(eng, BlockManager(32, 4))
    stale = Sequence("stale", PROMPTS[1], lora=a)
    d.bm.allocate(stale, 3)
    with pytest.raises(LoraNotLoaded, match="no longer loaded"):
        eng.execute([(stale, 3)])
    off = PagedLlamaRunner(copy.deepcopy(base), num_blocks=8, block_size=4, max_loaded_loras=0)
    with pytest.raises(LoraSlotsFull, match="max_loaded_loras=0"):
        off.lora.load("a", root / "all")


def _folder(tmp_path, name, config=None, tensors=None, raw=None):
    from safetensors.torch import save_file
    f = tmp_path / name
    f.mkdir()
    if config is not None:
        (f / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(f / "adapter_model.safetensors"))
    if raw is not None:
        (f / "adapter_model.safetensors").write_bytes(raw)
    return f


def test_bad_folders_are_refused_with_the_reason(tiny, tmp_path):
    base, root, _ = tiny
    eng = PagedLlamaRunner(copy.deepcopy(base), num_blocks=8, block_size=4, max_lora_rank=4)
    ok_cfg = json.loads((root / "qv_rs" / "adapter_config.json").read_text())
    pre = "base_model.model.model.layers.0."
    good = {pre + "self_attn.q_proj.lora_A.weight": torch.randn(4, 64),
            pre + "self_attn.q_proj.lora_B.weight": torch.randn(64, 4)}
    bin_only = _folder(tmp_path, "bin", ok_cfg)
    (bin_only / "adapter_model.bin").write_bytes(b"pickle")
    cases = [
        (tmp_path / "missing", "not a folder"),
        (_folder(tmp_path, "nocfg", tensors=good), "no adapter_config.json"),
        (_folder(tmp_path, "badjson", "{nope", good), "not readable JSON"),
        (_folder(tmp_path, "noweights", ok_cfg), "no adapter_model.safetensors"),
        (bin_only, "only safetensors"),
        (_folder(tmp_path, "garbage", ok_cfg, raw=b"\x00" * 40), "not a readable safetensors"),
        (_folder(tmp_path, "prefix", {**ok_cfg, "peft_type": "PREFIX_TUNING"}, good), "not LORA"),
        (_folder(tmp_path, "dora", {**ok_cfg, "use_dora": True}, good), "DoRA"),
        (_folder(tmp_path, "bias", {**ok_cfg, "bias": "all"}, good), "bias"),
        (_folder(tmp_path, "save", {**ok_cfg, "modules_to_save": ["lm_head"]}, good), "modules_to_save"),
        (_folder(tmp_path, "rank", {**ok_cfg, "r": 8}, good), "above max_lora_rank 4"),
        (_folder(tmp_path, "r0", {**ok_cfg, "r": 0}, good), "positive integer"),
        (_folder(tmp_path, "target", {**ok_cfg, "target_modules": ["lm_head"]}, good), "lm_head"),
        (_folder(tmp_path, "embed", ok_cfg, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(4, 300)}),
         "not a LoRA A/B weight"),
        (_folder(tmp_path, "half", ok_cfg, {pre + "self_attn.q_proj.lora_A.weight": torch.randn(4, 64)}),
         "must come together"),
        (_folder(tmp_path, "shape", ok_cfg, {pre + "self_attn.q_proj.lora_A.weight": torch.randn(4, 96),
                                             pre + "self_attn.q_proj.lora_B.weight": torch.randn(64, 4)}),
         "do not fit the base"),
        (_folder(tmp_path, "rankmix", ok_cfg, {pre + "self_attn.q_proj.lora_A.weight": torch.randn(2, 64),
                                               pre + "self_attn.q_proj.lora_B.weight": torch.randn(64, 2)}),
         "rank r=4"),
        (_folder(tmp_path, "layer", ok_cfg, {k.replace("layers.0.", "layers.7."): v for k, v in good.items()}),
         "no separate linear"),
        (_folder(tmp_path, "nan", ok_cfg, {**good, pre + "self_attn.q_proj.lora_B.weight": torch.full((64, 4), float("nan"))}),
         "not finite"),
        (_folder(tmp_path, "empty", ok_cfg, {}), "holds no LoRA weights"),
    ]
    for folder, why in cases:
        with pytest.raises(LoraFolderError, match=why) as info:
            eng.lora.load("bad", folder)
        assert isinstance(info.value, ValueError) and "'bad'" in str(info.value)
    assert eng.lora.loaded() == []                        # nothing half loaded
    ref = eng.lora.load("good", _folder(tmp_path, "good", ok_cfg, good))
    assert ref.slot == 0 and eng.lora.adapter("good").modules == ("q_proj",)


def test_the_runtime_never_imports_peft():
    import subprocess
    import sys

    code = ("import sys, actorserve.engine.weights.lora, actorserve.engine.runners.runner, actorserve.engine.weights.models; "
            "assert 'peft' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_hf_fallback_serves_no_adapter(tiny):
    from actorserve.engine.runners.runner import build_engine
    from transformers import GPT2Config, GPT2LMHeadModel

    base, root, _ = tiny
    eng = build_engine(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)).eval(),
                       num_blocks=8, block_size=4, max_loaded_loras=4)
    assert eng.lora is None
    from actorserve.engine.scheduling.sequence import LoraRef
    seq = Sequence("x", [1, 2, 3], lora=LoraRef("a", 0, 1, b"k"))
    with pytest.raises(ValueError, match="without adapters"):
        eng.execute([(seq, 3)])


# -- SmolLM2: dense, q4 and bf16 -----------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from actorserve.engine.weights.models import load_model, resolve_model

    clean = AutoModelForCausalLM.from_pretrained(str(resolve_model("default")), dtype=torch.float32,
                                                 local_files_only=True).eval()
    root = tmp_path_factory.mktemp("lora_smol")
    merged = {
        "attn": build_adapter(clean, root / "attn", seed=1, b_std=0.02, r=8, lora_alpha=16,
                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "mlp": build_adapter(clean, root / "mlp", seed=2, b_std=0.02, r=16, lora_alpha=16, use_rslora=True,
                             target_modules=["gate_proj", "up_proj", "down_proj"]),
    }
    _, tok, _ = load_model("default")
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    return root, merged, prompts, clean


def _smol_engine(root, **load_kw):
    from actorserve.engine.weights.models import load_model

    model, _, _ = load_model("default", threads=2, **load_kw)
    eng = PagedLlamaRunner(model, num_blocks=64, block_size=16, sampler=RecordingGreedy())
    for name in ("attn", "mlp"):
        eng.lora.load(name, root / name)
    return Driver(eng, BlockManager(64, 16))


@pytest.mark.model
@pytest.mark.parametrize("quantization", [None, "auto"])
def test_smollm2_adapters_decode_as_pefts_merged_model_fp32(smol, quantization):
    root, merged, prompts, clean = smol
    d = _smol_engine(root, quantization=quantization)
    fused: list[bool] = []
    if quantization:
        assert d.engine.fused is not None                 # decode steps, with adapters or not, fused
        run = d.engine.fused.run
        d.engine.fused.run = lambda *a: (fused.append(run(*a)), fused[-1])[1]
    want = {name: [hf_greedy(merged[name], p, 12) for p in prompts] for name in merged}
    assert want["attn"] != want["mlp"]
    for name in merged:
        assert d.run([new(d, f"{name}{i}", p, name) for i, p in enumerate(prompts)], 12) == want[name], name
    if quantization:                                      # adapter decode steps: fused, deltas in C
        assert fused == [True] * 2 * 11                   # 11 decode steps an adapter
        fused.clear()
    # and mixed: the base and both adapters in the same steps
    seqs = [new(d, "base", prompts[0], None), new(d, "x", prompts[0], "attn"), new(d, "y", prompts[1], "mlp")]
    assert d.run(seqs, 12) == [hf_greedy(clean, prompts[0], 12), want["attn"][0], want["mlp"][1]]
    if quantization:
        assert fused == [True] * 11                       # mixed decode steps fused too
        d.run([new(d, "base_alone", prompts[2], None)], 3)
        assert fused[-2:] == [True, True]                 # the base alone: its decode steps fused


@pytest.mark.model
def test_smollm2_adapter_in_bf16_agrees_with_the_fp32_merged_model(smol):
    """Along the fp32 merged model's greedy continuation, the bf16 engine with the adapter picks
    the same token wherever fp32's top-2 margin exceeds twice the largest logit difference."""
    root, merged, prompts, _ = smol
    d = _smol_engine(root, dtype=torch.bfloat16, quantization="auto")
    checked = 0
    for name in merged:
        for i, p in enumerate(prompts):
            cont = hf_greedy(merged[name], p, 10)
            with torch.inference_mode():
                ref = merged[name](torch.tensor([p + cont])).logits[0, len(p) - 1:len(p) + len(cont) - 1].float()
            seq = new(d, f"{name}{i}", p, name)
            feed = iter(cont)
            rows = []

            def forced(logits, seqs):
                rows.append(logits[0].float().clone())
                return [(next(feed), None, None)]

            keep, d.engine._sampler = d.engine._sampler, forced
            try:
                d.run([seq], len(cont))
            finally:
                d.engine._sampler = keep
            for step, (got, want) in enumerate(zip(rows, ref)):
                top2 = want.topk(2).values
                if top2[0] - top2[1] > 2 * (got - want).abs().max():
                    assert int(got.argmax()) == cont[step], (name, i, step)
                    checked += 1
    assert checked >= 10                                   # of 60 steps, 15 clear calls on the 2-core EPYC
