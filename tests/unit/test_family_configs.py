"""Each family's config at a published size plans on one node of 8 GPUs (the dry run: no device needed), with the
published shape (parameter count within 2% of the model card's) and the family's options in the plan."""

import pytest

from tests.conftest import load_plan
from trainer.dry_run import describe_plan

# config file: (family, published parameters in billions, a line the dry run prints)
CONFIGS = {
    "llama3_2_1b": ("llama3", 1.24, "Model: llama3 3.2-1B"),
    "llama3_1_8b": ("llama3", 8.03, "Model: llama3 3.1-8B"),
    "qwen2_5_7b": ("qwen2", 7.62, "Model: qwen2 2.5-7B"),
    "qwen3_8b": ("qwen3", 8.19, "Model: qwen3 8B"),
    "mistral_7b": ("mistral", 7.24, "Model: mistral 7B-v0.1"),
    "olmo2_7b": ("olmo2", 7.30, "Model: olmo2 7B"),
    "gemma3_1b": ("gemma3_text", 1.00, "Model: gemma3_text 1B"),
    "gemma2_2b": ("gemma2", 2.61, "Model: gemma2 2B"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_family_config_plans_on_8_gpus(name, tmp_path):
    family, billions, line = CONFIGS[name]
    plan = load_plan(["--job.dump_folder", str(tmp_path)], 8, config_file=f"configs/{name}.toml", check_memory=False)
    assert plan.spec.name == family
    assert plan.num_params == pytest.approx(billions * 1e9, rel=0.02)
    text = describe_plan(plan)
    assert line in text and "dp_shard 8 * cp 1 * tp 1 * pp 1 = 8 ranks" in text
    assert "attention block_causal (within documents)" in text


# mixture-of-experts configs: (family, world size, total and active parameters in billions, a line the dry run prints)
MOE_CONFIGS = {
    "gpt_oss_20b": ("gpt_oss", 8, 21.0, 3.6, "Model: gpt_oss 20b"),
    "gpt_oss_120b": ("gpt_oss", 64, 117.0, 5.1, "Model: gpt_oss 120b"),
    "mixtral_8x7b": ("mixtral", 16, 46.7, 12.9, "Model: mixtral 8x7B"),
}


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_a_mixture_of_experts_config_plans_with_expert_parallelism(name, tmp_path):
    """Total parameters as counted in the model; active ones as the model cards count them (every matmul weight a
    token uses, the output projection included, the embedding lookup not): the training FLOPs per token without
    the attention scores, / 6."""
    from trainer.models.decoder.model import attention_flops

    family, world, total, active, line = MOE_CONFIGS[name]
    plan = load_plan(["--job.dump_folder", str(tmp_path)], world, config_file=f"configs/{name}.toml",
                     check_memory=False)
    assert plan.spec.name == family
    assert plan.num_params == pytest.approx(total * 1e9, rel=0.02)
    args, seq = plan.model_args, plan.config.training.seq_len
    assert (plan.spec.flops_per_token(args, seq) - attention_flops(args, seq)) / 6 == pytest.approx(active * 1e9,
                                                                                                   rel=0.02)
    text = describe_plan(plan)
    assert line in text and f"dp_shard {world} * cp 1 * tp 1 * pp 1 = {world} ranks (ep 8 of dp_shard)" in text


def test_the_deepseek_v3_config_plans_on_256_gpus_with_expert_parallelism(tmp_path):
    """DeepSeek-V3 671B (37B active per token, the model card's counts) on 32 nodes: PP 8 x FSDP 32 with its experts
    sharded 32 ways."""
    plan = load_plan(["--job.dump_folder", str(tmp_path)], 256, config_file="configs/deepseek_v3_671b.toml",
                     check_memory=False)
    assert plan.spec.name == "deepseek_v3"
    assert plan.num_params == pytest.approx(671e9, rel=0.02)
    active = plan.num_params - plan.spec.idle_params(plan.model_args)
    assert active == pytest.approx(37e9, rel=0.02)
    text = describe_plan(plan)
    assert f"Model: deepseek_v3 671B, {plan.num_params / 1e6:,.2f}M parameters, {active / 1e6:,.2f}M active" in text
    assert "dp_shard 32 * cp 1 * tp 1 * pp 8 = 256 ranks (ep 32 of dp_shard)" in text
