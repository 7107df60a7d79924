"""Invariant 4 (one process): N steps straight == N/2 steps, checkpoint, resume, N/2 steps -
same weights and same metrics on CPU. The checkpoint carries weights, optimizer, data
position and RNG state; sampling uses the global RNG that the checkpoint restores."""
import numpy as np
import torch

from primitives.env.rewards import score_rollouts
from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task
from primitives.io.checkpoint import load_checkpoint, save_checkpoint
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import grpo
from primitives.maths.batching import make_batch
from primitives.model.generation import generate_rollouts
from primitives.model.training import forward_backward, optim_step, step_counts
from primitives.types import DataPosition, GenerationConfig, TrainState


def _fresh(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _steps(model, opt, tok, state, n):
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=40, num_heldout=1))[0]
    source, algo, history = make_prompt_source(items, seed=1), grpo(kl_coef=0.0), list(state.metrics_history)
    position = state.data_position
    for _ in range(n):
        batch_items, position = source(position, 5)
        rs = generate_rollouts(model, tok, batch_items, GenerationConfig(max_new_tokens=4, n=4))
        rs = score_rollouts(rs, lambda r: float(int(r.completion_ids.sum()) % 3) + arithmetic_reward(r))
        batch = make_batch(rs, algo, tok.pad_token_id)
        m = forward_backward(model, batch, algo, step_counts(batch))
        m["grad_norm"] = optim_step(model, opt, 1.0)
        m["uids"] = ",".join(r.uid for r in rs)
        history.append(m)
    return TrainState(iteration=state.iteration + n, global_step=state.global_step + n,
                      data_position=position, metrics_history=tuple(history))


def test_resume_equals_continuous(tmp_path, tiny_model_path, tokenizer):
    torch.manual_seed(123)
    model, opt = _fresh(tiny_model_path)
    straight = _steps(model, opt, tokenizer, TrainState(), 4)
    weights_straight = {n: p.detach().clone() for n, p in model.named_parameters()}

    torch.manual_seed(123)
    model, opt = _fresh(tiny_model_path)
    half = _steps(model, opt, tokenizer, TrainState(), 2)
    ckpt = save_checkpoint(str(tmp_path / "ckpt"), model, tokenizer, opt, half)
    torch.manual_seed(999)  # whatever happens between stop and resume must not matter
    model, opt = _fresh(tiny_model_path)
    state, _ = load_checkpoint(ckpt, model, opt)
    assert state.data_position == half.data_position and state.iteration == 2
    resumed = _steps(model, opt, tokenizer, state, 2)

    assert resumed.data_position == straight.data_position == DataPosition(0, 20)  # 4 steps x 5 prompts of 40
    for a, b in zip(straight.metrics_history, resumed.metrics_history):
        assert a["uids"] == b["uids"]
        assert a["loss/policy"] == b["loss/policy"] and a["grad_norm"] == b["grad_norm"]
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), weights_straight[n]), n
    assert max(float((p.detach() - _fresh(tiny_model_path)[0].get_parameter(n).detach()).abs().max())
               for n, p in model.named_parameters()) > 1e-4  # training really moved the weights
    assert len(resumed.metrics_history) == 4 and np.isfinite([m["grad_norm"] for m in resumed.metrics_history]).all()
