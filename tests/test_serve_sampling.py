"""Issue 40, item 3: sampling and scoring through the official `openai` client on a tiny model.

Log-probs are checked against a softmax this test computes itself from logits it recomputes
through a second engine for the prompt and the output so far; penalties and logit_bias change
what they should; requests without a seed differ and a reported seed replays; a missing
max_tokens is the room the prompt leaves. The LogitsProcessor hook is checked on the engine."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from engine.base.config import EngineConfig
from engine.run.generate import Generation, Sampler, generate
from engine.run.sampling import Penalties
from engine.run.runtime import Engine

from colibri_tiny import make_tiny
from test_serve import CTX, Server

EOS = 256          # the synth tokenizer's <|endoftext|> (engine/synth/bpe_tokenizer.py)
MERGES = range(257, 300)  # its merged tokens (2 bytes or more); 0..255 are single bytes
NO_EOS = {str(EOS): -100}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("sampling") / "tiny")


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny, queue_size=4)
    yield s
    s.close()


@pytest.fixture(scope="module")
def oracle(tiny):
    """A second engine on the same files: the test's own logits."""
    with Engine(tiny, EngineConfig(ctx_size=CTX, threads=1)) as engine:
        yield engine


def model_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of the next-token logits after `ids`, computed here from a fresh prefill."""
    return torch.log_softmax(engine.forward(ids, 0, last_only=True)[-1].float(), dim=-1)


def test_chat_logprobs_are_the_models_softmax(server, oracle):
    messages = [{"role": "user", "content": "Say something."}]
    out = server.client().chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                  logprobs=True, top_logprobs=5, logit_bias=NO_EOS)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 12
    # bytes are exact: together they are the answer's text
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == out.choices[0].message.content
    prompt = server.state.template.render(messages, add_generation_prompt=True)
    ids = server.state.tokenizer.encode(prompt, add_special_tokens=False).ids
    for c in content:
        lp = model_logprobs(oracle, ids)
        lp_no_eos = lp.clone()
        lp_no_eos[EOS] = -float("inf")
        chosen = int(torch.argmax(lp_no_eos))  # greedy on the biased logits; the report is the unbiased model's
        assert c.logprob == pytest.approx(float(lp[chosen]), abs=1e-4)
        top = torch.topk(lp, 5)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert len(c.top_logprobs) == 5
        ids.append(chosen)


def test_completion_logprobs_of_a_sampled_run_are_the_unscaled_softmax(server, oracle):
    # temperature 1.7 changes what is drawn, not what is reported: the model's own log-probs.
    prompt = [10, 20, 30, 40]
    out = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=1.7, seed=11,
                                             logprobs=3, logit_bias=NO_EOS)
    lp_obj = out.choices[0].logprobs
    assert len(lp_obj.tokens) == len(lp_obj.token_logprobs) == len(lp_obj.top_logprobs) == 10
    assert lp_obj.text_offset[0] == 0 and lp_obj.text_offset == sorted(lp_obj.text_offset)
    ids = list(prompt)
    for token, reported, top in zip(lp_obj.tokens, lp_obj.token_logprobs, lp_obj.top_logprobs):
        lp = model_logprobs(oracle, ids)
        assert sorted(top.values(), reverse=True) == pytest.approx(torch.topk(lp, 3).values.tolist(), abs=1e-4)
        # the drawn token: the one whose log-prob and text are those reported
        found = [i for i in range(lp.numel()) if abs(float(lp[i]) - reported) < 1e-4
                 and (token.startswith("bytes:") or oracle_text(server, i) == token)]
        assert found, (token, reported)
        ids.append(found[0])


def oracle_text(server, token: int) -> str:
    return server.state.tokenizer.decode([token])


def test_streamed_logprobs_cover_every_counted_token(server):
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Go"}], max_tokens=9, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, stream_options={"include_usage": True}, logit_bias=NO_EOS))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens == 9
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == text


def greedy_ids(server, **extra) -> list[bytes]:
    """The tokens (as their bytes) of a greedy 48-token chat answer under `extra` sampling fields."""
    out = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me more."}], max_tokens=48, temperature=0,
        logprobs=True, **{"logit_bias": NO_EOS, **extra})
    return [bytes(c.bytes) for c in out.choices[0].logprobs.content]


def repeats(tokens: list[bytes]) -> int:
    return len(tokens) - len(set(tokens))


@pytest.mark.parametrize("field, value", [("frequency_penalty", 2.0), ("presence_penalty", 2.0)])
def test_penalties_lower_repeats(server, field, value):
    plain = greedy_ids(server)
    assert repeats(plain) > 8  # a tiny random model loops when greedy: the thing penalties are for
    penalized = greedy_ids(server, **{field: value})
    assert repeats(penalized) < repeats(plain)


def test_repetition_penalty_lowers_repeats(server):
    plain = greedy_ids(server)
    assert repeats(greedy_ids(server, extra_body={"repetition_penalty": 3.0})) < repeats(plain)


def test_each_penalty_changes_the_logits_it_should():
    """What each field does to one step's logits: presence takes its value once from every token
    generated so far, frequency its value per occurrence, neither touches a token seen only in the
    prompt; repetition divides a positive logit (multiplies a negative one) of a token seen in the
    prompt or the output; logit_bias adds; a token never seen is left alone."""
    logits = torch.tensor([1.0, -1.0, 2.0, 0.0, 3.0, -2.0])
    prompt, generated = [1, 2], [4, 4, 5]
    pen = Penalties(Sampler(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 10.0}), prompt, 6)
    for t in generated:
        pen.accept(t)
    assert pen(logits, generated).tolist() == pytest.approx([1.0, -1.0, 2.0, 10.0, 3.0 - 0.5 - 2 * 0.25,
                                                             -2.0 - 0.5 - 0.25])
    pen = Penalties(Sampler(repetition_penalty=2.0), prompt, 6)
    for t in generated:
        pen.accept(t)
    assert pen(logits, generated).tolist() == pytest.approx([1.0, -2.0, 1.0, 0.0, 1.5, -4.0])
    assert logits.tolist() == [1.0, -1.0, 2.0, 0.0, 3.0, -2.0]  # the raw logits (log-probs' source) unchanged


def test_logit_bias_forces_and_bans(server):
    client = server.client()
    forced = client.completions.create(model="tiny", prompt="x", max_tokens=10, temperature=1.0, seed=3,
                                       logit_bias={"65": 100})
    assert forced.choices[0].text == "A" * 10  # id 65 is the byte "A"
    # every single-byte token and end-of-sequence banned: only merged tokens (2+ bytes) are left
    banned = {str(i): -100 for i in range(EOS + 1)}
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=24,
                                         temperature=1.5, seed=5, logprobs=True, logit_bias=banned)
    assert all(len(c.bytes) >= 2 for c in out.choices[0].logprobs.content)


def test_min_p_one_is_greedy(server):
    client = server.client()
    greedy = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0,
                                       logit_bias=NO_EOS).choices[0].text
    for seed in (1, 2):
        sampled = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=2.0, seed=seed,
                                            logit_bias=NO_EOS, extra_body={"min_p": 1.0})
        assert sampled.choices[0].text == greedy  # only tokens as likely as the top one are kept


def test_unseeded_requests_differ_and_the_reported_seed_replays(server):
    client = server.client()
    runs = []
    for _ in range(3):
        raw = client.completions.with_raw_response.create(model="tiny", prompt="Once", max_tokens=16,
                                                          temperature=1.0, logit_bias=NO_EOS)
        body = raw.parse()
        assert int(raw.headers["x-colibri-seed"]) == body.to_dict()["seed"]
        runs.append((body.to_dict()["seed"], body.choices[0].text))
    assert len({seed for seed, _ in runs}) == 3
    assert len({text for _, text in runs}) > 1
    seed, text = runs[0]
    again = client.completions.create(model="tiny", prompt="Once", max_tokens=16, temperature=1.0, seed=seed,
                                      logit_bias=NO_EOS)
    assert again.choices[0].text == text
    with client.chat.completions.with_streaming_response.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True) as streamed:
        assert streamed.headers["x-colibri-seed"].isdigit()


def test_no_max_tokens_is_the_room_left(server):
    tokenizer, template = server.state.tokenizer, server.state.template

    def prompt(words: int):
        messages = [{"role": "user", "content": "word " * words}]
        return messages, len(tokenizer.encode(template.render(messages, add_generation_prompt=True),
                                              add_special_tokens=False).ids)

    # a user message whose prompt is ~1832 tokens on the 2048-token context (the case)
    lo, hi = 1, 4 * CTX
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if prompt(mid)[1] < 1832 else (lo, mid)
    messages, n = prompt(lo)
    assert 1832 <= n < CTX
    out = server.client().chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                  logit_bias=NO_EOS)
    assert out.usage.prompt_tokens == n
    assert out.usage.completion_tokens == CTX - n and out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"n": 2}, "n"),  # above this server's max_batch (1)
    ({"n": 0}, "n"),
])
def test_out_of_range_sampling_fields_are_refused_by_name(server, body, param):
    r = httpx.post(server.base + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


def test_completions_logprobs_range(server):
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    # n choices run together: more than the server's max_batch (1 here) is refused by name
    with pytest.raises(openai.BadRequestError, match="--max-batch"):
        server.client().completions.create(model="tiny", prompt="x", max_tokens=2, n=3)


class BanAfter:
    """A LogitsProcessor: bans one token, and is done after `n` accepted tokens."""

    def __init__(self, banned: int, n: int):
        self.banned, self.n, self.seen = banned, n, []

    def __call__(self, logits, generated):
        assert list(generated) == self.seen  # the ids so far, before this step's
        out = logits.clone()
        out[self.banned] = -float("inf")
        return out

    def accept(self, token):
        self.seen.append(token)

    def done(self):
        return len(self.seen) >= self.n


def test_logits_processors_shape_the_step_and_end_the_generation(oracle):
    prompt = [1, 2, 3]
    plain = generate(oracle, prompt, 6, Sampler()).output_ids
    proc = BanAfter(plain[0], 4)
    seen_by_callback: list[int] = []
    gen = Generation(list(prompt))
    out = generate(oracle, prompt, 20, Sampler(), on_token=seen_by_callback.append, processors=[proc],
                   logprobs=0, generation=gen)
    assert out is gen and out.stopped_by_processor
    assert len(out.output_ids) == 4 and plain[0] not in out.output_ids
    assert proc.seen == out.output_ids == seen_by_callback  # the last token still reaches on_token
    assert [e.token for e in out.logprobs] == out.output_ids
    with pytest.raises(Exception, match="no token allowed"):
        generate(oracle, prompt, 2, Sampler(), processors=[_AllBanned()])


class _AllBanned(BanAfter):
    def __init__(self):
        super().__init__(0, 99)

    def __call__(self, logits, generated):
        return torch.full_like(logits, -float("inf"))


def test_a_jobs_processors_run_in_the_worker_and_end_it_with_stop(server):
    import threading
    from colibri.serve.protocol import Sampling
    from colibri.serve.worker import Job
    done, box = threading.Event(), []

    def emit(kind, value):
        if kind == "done":
            box.append(value)
            done.set()

    proc = BanAfter(EOS, 3)
    server.model.worker.submit(Job([5, 6, 7], Sampling(max_tokens=50, temperature=0, top_p=1, seed=0), emit,
                                   processors=[proc]))
    assert done.wait(60)
    assert box[0].finish_reason == "stop" and box[0].output_ids == proc.seen and len(proc.seen) == 3
