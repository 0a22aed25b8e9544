"""The dense model families people bring from the Hub (issue 60), each against transformers' own class, on tiny
random models made with the options of the family's published config.json: the imported model computes
transformers' logits (relative 1e-5, float32), greedy generation of 20 tokens gives transformers' tokens with and
without our KV cache, and after one training step the exported folder computes our logits in transformers.

The prompt is longer than the sliding windows (8 tokens), so the windows are exercised in the forward and in
generation's cache; norms are moved away from their initial values so that a weight laid out wrongly shows.
"""

import pytest
import torch
import transformers

from tests.integration.test_hf_roundtrip import PROMPT, logits_of
from trainer import convert
from trainer import generate as gen
from trainer.config import load_config
from trainer.convert import load_checkpoint
from trainer.data.tokenizer import HFTokenizer, Tokenizer
from trainer.train import main

T = transformers
VOCAB = 512
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=128, bos_token_id=VOCAB - 2,
             eos_token_id=VOCAB - 1, initializer_range=0.2, tie_word_embeddings=False)
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64, "rope_theta": 500000.0}
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"])
# DeepSeek-V3 at tiny size: latent attention (q through a latent, or one projection), yarn with DeepSeek's two
# mscales (the softmax scale), 8 experts in 4 groups of which 2 are eligible, a shared expert, the first block dense.
DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7,
                                 "rope_theta": 10000.0})
# case: (our family, transformers model class, config class, options)
CASES = {
    "llama-3.1": ("llama3", T.LlamaForCausalLM, T.LlamaConfig, dict(rope_parameters=LLAMA31)),
    "llama-3.2-tied": ("llama3", T.LlamaForCausalLM, T.LlamaConfig, dict(
        rope_parameters={**LLAMA31, "factor": 32.0}, tie_word_embeddings=True, head_dim=8)),
    "llama-linear": ("llama3", T.LlamaForCausalLM, T.LlamaConfig, dict(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "llama-dynamic": ("llama3", T.LlamaForCausalLM, T.LlamaConfig, dict(
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    "qwen2": ("qwen2", T.Qwen2ForCausalLM, T.Qwen2Config, dict(rope_parameters={"rope_theta": 1e6})),
    "qwen3": ("qwen3", T.Qwen3ForCausalLM, T.Qwen3Config, dict(head_dim=32, rope_parameters={"rope_theta": 1e6})),
    "mistral": ("mistral", T.MistralForCausalLM, T.MistralConfig, dict(sliding_window=8)),
    "mistral-full": ("mistral", T.MistralForCausalLM, T.MistralConfig, dict(sliding_window=None)),
    "olmo2": ("olmo2", T.Olmo2ForCausalLM, T.Olmo2Config, dict(rope_parameters={"rope_theta": 5e5})),
    "gemma3_text": ("gemma3_text", T.Gemma3ForCausalLM, T.Gemma3TextConfig, dict(
        **GEMMA, tie_word_embeddings=True, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "gemma2": ("gemma2", T.Gemma2ForCausalLM, T.Gemma2Config, dict(
        **GEMMA, tie_word_embeddings=True, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "granite": ("granite", T.GraniteForCausalLM, T.GraniteConfig, dict(
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0)),
    "mixtral": ("mixtral", T.MixtralForCausalLM, T.MixtralConfig, dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None, rope_parameters={"rope_theta": 1e6})),
    # Sliding and full layers alternating (window 8, shorter than the prompt), yarn without truncation; the clamp
    # at 0.5 is reached by the tiny model's gate and up values, so a missing clamp shows.
    "gpt_oss": ("gpt_oss", T.GptOssForCausalLM, T.GptOssConfig, dict(
        num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8, swiglu_limit=0.5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_parameters={
            "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 16, "rope_theta": 150000.0})),
    "deepseek_v3": ("deepseek_v3", T.DeepseekV3ForCausalLM, T.DeepseekV3Config, DEEPSEEK),
    # Without the q latent, and routing values other than the flavor's (so that each must be read from config.json):
    # 2 groups of which 1 is eligible, 2 shared experts, no dense block, another scale, weights not renormalised, and
    # an rms_norm_eps that the latent norms do not take (they keep 1e-6).
    "deepseek_v3-no-q-lora": ("deepseek_v3", T.DeepseekV3ForCausalLM, T.DeepseekV3Config, dict(
        DEEPSEEK, q_lora_rank=None, num_hidden_layers=2, n_group=2, topk_group=1, n_shared_experts=2,
        first_k_dense_replace=0, routed_scaling_factor=1.7, norm_topk_prob=False, rms_norm_eps=1e-5)),
}


def hf_model(case: str):
    _, model_cls, config_cls, options = CASES[case]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SMALL, **options})).eval()
    with torch.no_grad():  # norms away from their initial values, so that a wrong layout of a norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape))
            elif name.endswith(("proj.bias", "_bias", "router.bias", "sinks")):  # sinks and biases (gpt-oss)
                p.add_(0.5 * torch.randn(p.shape))
        for name, b in model.named_buffers():  # DeepSeek's choosing bias, on the scale of the scores
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape))
    return model


def test_every_case_names_a_registered_family():
    from trainer.models import get_model_spec

    for case, (family, _, _, _) in CASES.items():
        assert get_model_spec(family).hf.model_type == hf_model(case).config.model_type, case


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_family_imports_trains_exports_and_generates_like_transformers(case, tmp_path):
    family = CASES[case][0]
    source = hf_model(case)
    source.save_pretrained(str(tmp_path / "hf"))
    Tokenizer(max_ranks=VOCAB - 2).save_hf(tmp_path / "hf")
    assert convert.run(["from-hf", str(tmp_path / "hf"), str(tmp_path / "seed")]) == 0
    assert f'name = "{family}"' in (tmp_path / "seed" / "model.toml").read_text()
    tok = HFTokenizer(tmp_path / "seed" / "tokenizer.json")
    ids = tok.encode(PROMPT, bos=True)
    assert len(ids) > 8  # longer than the sliding windows
    seed = load_checkpoint(tmp_path / "seed" / "checkpoint",
                           ["--job.config_file", str(tmp_path / "seed" / "model.toml")], key="test", seq_len=64)
    torch.testing.assert_close(logits_of(seed.model, ids), logits_of(source, ids), rtol=1e-5, atol=1e-5)

    # Greedy generation: transformers' 20 tokens, with and without our KV cache.
    theirs = source.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    assert gen.generate(seed.model, ids, max_new_tokens=20, eos_id=None) == theirs
    assert gen.generate(seed.model, ids, max_new_tokens=20, eos_id=None, kv_cache=False) == theirs

    # One training step (under the default block-causal attention), exported, computes our logits in transformers.
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{tmp_path / "seed" / "model.toml"}"\n[training]\nsteps = 1\nseq_len = 32\n'
                   f'local_batch_size = 2\nmixed_precision_param = "float32"\n[checkpoint]\nenable = true\n'
                   f'[metrics]\nenable_tensorboard = false\n[job]\ndump_folder = "{tmp_path / "run"}"\n')
    assert main(load_config(job)).losses
    step = tmp_path / "run" / "checkpoint" / "step-1"
    assert convert.run(["to-hf", str(step), str(tmp_path / "out")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert type(exported) is type(source)
    ours = load_checkpoint(step, [], key="test", seq_len=64)
    trained = logits_of(ours.model, ids)
    assert not torch.allclose(trained, logits_of(seed.model, ids))  # the step changed the weights
    torch.testing.assert_close(logits_of(exported, ids), trained, rtol=1e-5, atol=1e-5)


def test_a_hub_id_is_read_from_the_cache_offline_or_said_in_one_line(tmp_path, monkeypatch, capsys):
    """``convert from-hf`` and ``[checkpoint] initial_load_path`` take a Hub id: offline (as every test runs), a model
    in the Hugging Face cache (a local mirror) is used; one that is not is one line naming the argument or key."""
    import huggingface_hub.constants

    from tests.conftest import load_plan
    from trainer.errors import UserError

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    revision = "0" * 40
    snapshot = cache / "models--org--tiny-qwen3" / "snapshots" / revision
    hf_model("qwen3").save_pretrained(str(snapshot))
    Tokenizer(max_ranks=VOCAB - 2).save_hf(snapshot)
    (cache / "models--org--tiny-qwen3" / "refs").mkdir()
    (cache / "models--org--tiny-qwen3" / "refs" / "main").write_text(revision)

    assert convert.run(["from-hf", "org/tiny-qwen3", str(tmp_path / "seed")]) == 0
    assert 'name = "qwen3"' in (tmp_path / "seed" / "model.toml").read_text()
    plan = load_plan(["--model.name", "qwen3", "--checkpoint.initial_load_path", "org/tiny-qwen3"], 1)
    assert plan.config.checkpoint.initial_load_path == str(snapshot)  # the run reads the cached folder
    assert (plan.model_args.dim, plan.model_args.head_dim) == (64, 32)  # config.json's shape adopted

    capsys.readouterr()
    assert convert.run(["from-hf", "org/absent", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert ("error: from-hf HF_FOLDER: org/absent is not a folder here, not in the Hugging Face cache, and the Hub"
            " cannot be reached") in err
    with pytest.raises(UserError, match=r"\[checkpoint\] initial_load_path: org/absent is not a folder here"):
        load_plan(["--model.name", "qwen3", "--checkpoint.initial_load_path", "org/absent"], 1)


def test_an_imported_mixture_trains_a_choosing_bias_its_checkpoint_has_no_place_for(tmp_path, caplog):
    """A Mixtral folder (no choosing bias in its layout) trained with the auxiliary-loss-free balancing: the bias
    starts at zero, said in one line, rather than the load failing on a tensor the layout cannot name."""
    hf_model("mixtral").save_pretrained(str(tmp_path / "hf"))
    Tokenizer(max_ranks=VOCAB - 2).save_hf(tmp_path / "hf")
    job = tmp_path / "job.toml"
    job.write_text(f'[model]\nname = "mixtral"\ntokenizer_path = "{tmp_path / "hf" / "tokenizer.json"}"\n'
                   f'[model.overrides]\nbias_update_speed = 0.001\n'
                   f'[checkpoint]\ninitial_load_path = "{tmp_path / "hf"}"\n'
                   f'[training]\nsteps = 1\nseq_len = 32\nlocal_batch_size = 2\nmixed_precision_param = "float32"\n'
                   f'[metrics]\nenable_tensorboard = false\n[job]\ndump_folder = "{tmp_path / "run"}"\n')
    with caplog.at_level("INFO"):
        assert main(load_config(job)).losses
    assert "moe.router.expert_bias keeps its initial value" in caplog.text
