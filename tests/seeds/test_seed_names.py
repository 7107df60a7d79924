"""The seeds' remaining names, each doing the seed's job or refused naming the supported form:
``compute_kl`` (seeds/001), ``combine_rewards`` of ``length_reward`` / ``keyword_reward`` and the
undefined ``safety_check_reward`` (seeds/003), ``get_algorithm_for_iteration`` (seeds/003),
``select_top_bottom_pairs`` and the reference helpers of seeds/000's docstrings, the plan's
``tokenize_conversation`` / ``compute_loss_mask`` / ``load_sft_samples`` and ``SGLangEngine``
(seeds/004)."""
import http.server
import json
import math
import os
import re

import numpy as np
import pytest
import torch

import rl_primitives as rp
from primitives.io.data import prepare_sft_chat
from primitives.types import Rollout
from tests.conftest import local_http_server

# k3 = r - 1 - log r with r = exp(ref - lp), worked by hand for lp [-1, -2], ref [-1.5, -1]
K3 = [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1]  # 0.106531, 0.718282


def test_compute_kl_sums_k3_over_the_tokens_or_the_given_per_token_kl():
    assert rp.compute_kl([-1.0, -2.0], [-1.5, -1.0]) == pytest.approx(sum(K3), abs=1e-6)  # 0.824812
    truncated = rp.compute_kl([-1.0, -2.0], [-1.5, -1.0], kl_fn=rp.create_truncated_kl(0.5))
    assert truncated == pytest.approx(K3[0] + 0.5, abs=1e-6)
    rows = rp.compute_kl(torch.tensor([[-1.0, -2.0], [-1.0, -2.0]]), torch.tensor([[-1.5, -1.0], [-1.5, -1.0]]),
                         valid_mask=torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    assert rows.tolist() == pytest.approx([K3[0], sum(K3)], abs=1e-6)
    per_sequence = rp.compute_kl([-1.0, -2.0], [-1.5, -1.0], kl_fn=lambda lp, ref, m: ((lp - ref) * m).sum(-1))
    assert per_sequence == pytest.approx(-0.5, abs=1e-6)  # a (B,) answer is taken as it is: 0.5 - 1.0


def test_compute_kl_refuses_the_seeds_float_list_kl_and_other_shapes():
    def truncated_kl(logprobs, ref_logprobs, threshold=1.0):  # seeds/002, README error 2
        return min(sum(math.exp(a) * (a - b) for a, b in zip(logprobs, ref_logprobs)), threshold)

    with pytest.raises(ValueError, match=r"compute_kl: kl_fn .*truncated_kl failed on \[B, T\] tensors .* the "
                                         r"documented signature is kl_fn\(logp, ref_logp, mask\) -> \(B, T\)"):
        rp.compute_kl([-1.0, -2.0], [-1.5, -1.0], kl_fn=truncated_kl)
    with pytest.raises(ValueError, match=r"returned shape \(\) for \(1, 2\) logprobs; it must return per-token"):
        rp.compute_kl([-1.0, -2.0], [-1.5, -1.0], kl_fn=lambda lp, ref, m: (lp - ref).sum())
    with pytest.raises(ValueError, match="differ in shape"):
        rp.compute_kl([-1.0, -2.0], [-1.5])
    with pytest.raises(ValueError, match=r"valid_mask \(3,\) and logprobs \(2,\) differ in shape"):
        rp.compute_kl([-1.0, -2.0], [-1.5, -1.0], valid_mask=[1, 1, 0])
    half = rp.compute_kl([-1.0, -2.0], [-1.5, -1.0], valid_mask=[1.0, 0.5])  # k3 weighted by the mask once
    assert half == pytest.approx(K3[0] + 0.5 * K3[1], abs=1e-6)


def _rollout(text: str) -> Rollout:
    return Rollout(uid="e0/i0/s0", group="e0/i0", prompt="p", prompt_ids=np.array([1]),
                   completion_ids=np.arange(3), loss_mask=np.ones(3, np.float32), logprobs=np.zeros(3, np.float32),
                   text=text)


def test_keyword_and_length_rewards_by_hand():
    said = _rollout("Because it rains, therefore, wet.")  # 33 characters
    assert rp.keyword_reward(["because", "therefore", "hence"])(said) == pytest.approx(2 / 3)
    assert rp.keyword_reward(["because"], case_sensitive=True)(said) == 0.0
    assert rp.keyword_reward(["rain"])(said) == 0.0  # whole words: "rains" is not "rain"
    assert rp.keyword_reward(["it rains"], reward=2.0)(said) == 2.0  # a phrase as written
    assert [rp.length_reward(min_length=m)(said) for m in (33, 34)] == [1.0, 0.0]
    assert rp.length_reward(10, max_length=32)(said) == 0.0 and rp.length_reward(10, 33, reward=0.5)(said) == 0.5
    for bad in ([], "because", ["because", True], ["  "]):  # a string is its letters; YAML's yes is True
        with pytest.raises(ValueError, match="keyword_reward needs a list of non-empty strings"):
            rp.keyword_reward(bad)
    with pytest.raises(ValueError, match=r"length_reward: the window \[5, 2\] is empty"):
        rp.length_reward(5, 2)


def test_combine_rewards_as_seeds_003_composes_them():
    """seeds/003 "Compose Functions", with its undefined safety check left out: 0.5 x 1 + 0.3 x 2/3."""
    said = _rollout("Because it rains, therefore, wet.")
    reward_fn = rp.combine_rewards(rp.length_reward(min_length=10), rp.keyword_reward(["because", "therefore", "so"]),
                                   weights=[0.5, 0.3])
    assert reward_fn(said) == pytest.approx(0.5 + 0.2)
    assert rp.combine_rewards(rp.length_reward(min_length=10), rp.keyword_reward(["so"]))(said) == 1.0  # weights 1
    assert "0.5*length_reward(10, None)" in reward_fn.__qualname__
    for weights in ([1, 2, 3], [1, float("nan")]):
        with pytest.raises(ValueError, match="combine_rewards: 2 reward functions need as many finite weights"):
            rp.combine_rewards(rp.length_reward(), rp.keyword_reward(["a"]), weights=weights)
    with pytest.raises(TypeError, match=r"combine_rewards\(\*reward_fns, weights=...\) takes reward functions"):
        rp.combine_rewards([rp.length_reward()])
    with pytest.raises(Exception, match="nan_reward"):
        def nan_reward(rollout):
            return float("nan")
        rp.combine_rewards(rp.length_reward(), nan_reward)(said)
    with pytest.raises(TypeError, match=r"safety_check_reward\(\): the seeds never define it.*create_rm_reward_fn"):
        rp.combine_rewards(rp.length_reward(100), rp.keyword_reward(["because"]), rp.safety_check_reward(),
                           weights=[0.5, 0.3, 0.2])


def test_keywords_is_a_job_reward_by_name():
    from primitives.env.rewards import RewardSpec, build_reward

    reward_fn, _, names = build_reward([RewardSpec("keywords", weight=2.0, kwargs={"keywords": ["because", "so"]})])
    assert reward_fn(_rollout("because")) == pytest.approx(1.0) and names == ("keywords",)


def test_the_algorithm_and_reference_helpers_of_the_seeds():
    switch = lambda i: "grpo" if i < 50 else "ppo"  # noqa: E731
    assert rp.get_algorithm_for_iteration(60, switch) == rp.get_algorithm_config(60, switch)
    with pytest.raises(TypeError, match=r"get_algorithm_for_iteration\(7\): which algorithm .* algorithm_schedule="):
        rp.get_algorithm_for_iteration(7)
    assert rp.select_top_bottom_pairs is rp.top_bottom_pairs
    for helper, form in ((rp.create_ema_model, "create_ref_update_fn('ema', decay=0.999)"),
                         (rp.copy_params, "create_ref_update_fn('periodic', reset_every=1)"),
                         (rp.reset_if_needed, "create_ref_update_fn('periodic', reset_every=N)")):
        with pytest.raises(TypeError, match=rf"{helper.__name__}\(...\) is a helper .* {re.escape(form)}"):
            helper(torch.nn.Linear(1, 1), 0.999)


def test_tokenize_conversation_and_its_loss_mask_learn_only_the_assistant(tokenizer):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
                    {"role": "assistant", "content": "6"}]
    tokens, user_spans = rp.tokenize_conversation(conversation, tokenizer)
    ours = prepare_sft_chat(tokenizer, conversation)
    mask = rp.compute_loss_mask(tokens, user_spans)
    assert tokens == ours.input_ids.tolist() and mask == ours.loss_mask.astype(int).tolist()
    assert len(user_spans) == 2 and user_spans[0][0] == 0  # before each answer, from the start
    learned = tokenizer.decode([t for t, m in zip(tokens, mask) if m])
    assert "4" in learned and "6" in learned and "2+2" not in learned and "brief" not in learned
    assert rp.compute_loss_mask([5, 6, 7, 8], [(0, 1), (2, 4)]) == [0, 1, 0, 0]
    with pytest.raises(ValueError, match=r"span 1 \(2, 9\) is outside the 4 tokens"):
        rp.compute_loss_mask([5, 6, 7, 8], [(0, 1), (2, 9)])


def test_load_sft_samples_reads_chats_and_pairs_into_the_plans_samples(tokenizer, tmp_path):
    chats, pairs = tmp_path / "chats.jsonl", tmp_path / "pairs.jsonl"
    conversation = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    chats.write_text(json.dumps({"messages": conversation}) + "\n")
    pairs.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n" + json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(TypeError, match=r"load_sft_samples\('nowhere.jsonl'\): .* load_sft_samples\('nowhere.jsonl', "
                                        r"tokenizer\)"):
        rp.load_sft_samples("nowhere.jsonl")  # the seeds' call: refused before the file is looked for
    [chat] = rp.load_sft_samples(str(chats), tokenizer)
    ours = prepare_sft_chat(tokenizer, conversation)
    assert chat.input_ids.tolist() == chat.labels.tolist() == ours.input_ids.tolist()
    assert chat.loss_mask.tolist() == ours.loss_mask.tolist()
    with pytest.raises(KeyError, match=rf"{os.path.basename(pairs)}:2: missing field .completion."):
        rp.load_sft_samples(str(pairs), tokenizer)
    pairs.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    [pair] = rp.load_sft_samples(str(pairs), tokenizer)
    prompt = tokenizer("2+2=", add_special_tokens=False).input_ids
    assert pair.input_ids.tolist()[:len(prompt)] == prompt and pair.input_ids.tolist()[-1] == tokenizer.eos_token_id
    assert pair.loss_mask.tolist() == [0.0] * len(prompt) + [1.0] * (len(pair.input_ids) - len(prompt))
    batch = rp.collate_batch([chat, pair], batch_size=2, step=0, pad_id=tokenizer.pad_token_id)
    assert batch["loss_mask"].sum() == chat.loss_mask.sum() + pair.loss_mask.sum()


class _SGLang(http.server.BaseHTTPRequestHandler):
    """SGLang's ``POST /update_weights_from_disk`` as its server answers: 200 ``{"success": true,
    "message"}`` when the weights load, 400 ``{"success": false, "message"}`` when they do not
    (``mode`` "fail"); "garbage" answers what no SGLang server does."""

    loaded: list = []
    headers_seen: list = []
    mode = "ok"

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).headers_seen.append(self.headers.get("Authorization"))
        ok = self.path == "/update_weights_from_disk" and type(self).mode == "ok"
        if ok:
            type(self).loaded.append(body["model_path"])
        answer = json.dumps({"success": ok, "message": "Succeeded to update model weights." if ok else
                             "Failed to get weights iterator: shapes do not match"}).encode()
        if type(self).mode == "garbage":
            answer = b"<html>not found</html>"
        self.send_response(200 if ok or type(self).mode == "garbage" else 400)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def sglang_server():
    _SGLang.loaded, _SGLang.headers_seen, _SGLang.mode = [], [], "ok"
    with local_http_server(_SGLang) as server:
        yield f"http://127.0.0.1:{server.server_port}"


def test_sglang_engines_reload_the_checkpoint_at_each_sync(sglang_server, tmp_path, monkeypatch):
    """seeds/004's ``sync_weights_to_engines([SGLangEngine(base_url=...)], ckpt)``: the server is told to
    load the checkpoint's HF directory, by absolute path (the server's working directory is not ours);
    a refusal (400), a reply that is not SGLang's, or no server at all is an error naming it."""
    import asyncio

    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "step_10"
    (ckpt / "hf").mkdir(parents=True)
    (ckpt / "hf" / "config.json").write_text("{}")
    engine = rp.SGLangEngine(base_url=sglang_server + "/", api_key="sk-1")
    assert asyncio.run(rp.sync_weights_to_engines([engine], "step_10")) == 1  # relative, as a backend writes it
    assert _SGLang.loaded == [str(ckpt / "hf")] and engine.weight_version == 1
    assert _SGLang.headers_seen == ["Bearer sk-1"]
    _SGLang.mode = "fail"
    with pytest.raises(RuntimeError, match=rf"SGLang at {sglang_server}/update_weights_from_disk did not load "
                                           r".*hf: HTTP 400 .*shapes do not match"):
        engine.update_weights_from_checkpoint(str(ckpt))
    _SGLang.mode = "garbage"
    with pytest.raises(RuntimeError, match=r"answered b'<html>not found</html>', not SGLang's JSON"):
        engine.update_weights_from_checkpoint(str(ckpt))
    assert engine.weight_version == 1  # no failed sync is counted
    with pytest.raises(RuntimeError, match="did not answer .*is the server up"):
        rp.SGLangEngine("http://127.0.0.1:9", timeout_s=5).update_weights_from_checkpoint(str(ckpt))
    with pytest.raises(ValueError, match=r"SGLangEngine\(base_url='localhost:30000'\): an http\(s\) URL"):
        rp.SGLangEngine("localhost:30000")
