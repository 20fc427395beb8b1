"""`dflash serve` pieces without a server: text streaming with stop strings, request parsing,
vLLM-named spec-decode counters, the vLLM / SGLang hand-off command."""

from __future__ import annotations

import pytest

from dflash_cli.decoding.result import GenerationResult
from dflash_cli.decoding.text_stream import TextStream
from dflash_cli.recipe.schema import RunConfig
from dflash_cli.serve.metrics import ServerMetrics
from dflash_cli.serve.protocol import ApiError, parse_request


def chars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def stream_all(pieces: list[str], stops: list[str]) -> tuple[list[str], TextStream]:
    s = TextStream(chars, stops)
    out = [s.push([ord(c) for c in piece]) for piece in pieces]
    out.append(s.finish())
    return out, s


def test_text_stream_holds_back_a_possible_stop_then_releases_it():
    out, s = stream_all(["ab", "c<", "/x", "yz"], ["</s>"])
    assert out == ["ab", "c", "</x", "yz", ""] and not s.stopped


def test_text_stream_cuts_at_the_stop_string_and_never_sends_it():
    out, s = stream_all(["ab", "c<", "/s", ">tail"], ["</s>"])
    assert "".join(out) == "abc" and s.stopped and s.text == "abc"
    assert all("<" not in piece for piece in out)


def test_text_stream_earliest_of_several_stops():
    out, s = stream_all(["one END two STOP"], ["STOP", "END"])
    assert "".join(out) == "one " and s.stopped


def test_text_stream_waits_for_a_whole_character():
    s = TextStream(lambda ids: "x\ufffd" if len(ids) == 1 else "x\u00e9", [])
    assert s.push([1]) == "x"
    assert s.push([2]) == "\u00e9"


def test_parse_defaults_come_from_the_recipe_run_section():
    run = RunConfig(max_new_tokens=17, stop=["###"], seed=5)
    req = parse_request({"model": "m", "prompt": "hi"}, "completion", "m", run)
    assert (req.max_tokens, req.temperature, req.seed, req.stop) == (17, 0.0, 5, ["###"])
    req = parse_request({"prompt": ["hi"], "max_tokens": 3, "stop": "x", "top_k": -1}, "completion", "m", run)
    assert (req.prompt, req.max_tokens, req.stop, req.top_k) == ("hi", 3, ["x"], 0)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "other", "prompt": "x"}, "model"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "logprobs": 2, "stream": True, "echo": True}, "echo"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
    ],
)
def test_parse_refuses_bad_fields_naming_them(body, param):
    with pytest.raises(ApiError) as info:
        parse_request(body, "completion", "m", RunConfig())
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_neutral_values_of_fields_dflash_does_not_apply_pass():
    body = {"prompt": "x", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "repetition_penalty": 1}
    assert parse_request(body, "completion", "m", RunConfig()).prompt == "x"


def test_repetition_penalty_is_read_with_the_recipes_default():
    assert (
        parse_request({"prompt": "x", "repetition_penalty": 1.2}, "completion", "m", RunConfig()).repetition_penalty
        == 1.2
    )
    assert (
        parse_request({"prompt": "x"}, "completion", "m", RunConfig(repetition_penalty=1.3)).repetition_penalty == 1.3
    )


def test_parse_chat_messages_and_thinking_switch():
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 4,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    req = parse_request(body, "chat", "m", RunConfig())
    assert req.prompt == [{"role": "user", "content": "ab"}] and req.max_tokens == 4 and req.enable_thinking is False
    with pytest.raises(ApiError):
        parse_request({"messages": []}, "chat", "m", RunConfig())


def test_spec_decode_counters_follow_vllm_definitions():
    """Block 4: each verify step is one draft of 3 tokens; accepted excludes the target's bonus token."""
    m = ServerMetrics("m", block_size=4)
    m.record(GenerationResult("dflash", 5, list(range(9)), accept_lengths=[1, 4, 2, 2]), "length")
    text = m.render(running=0, waiting=2)
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text  # 0 + 3 + 1 + 1
    for pos, n in enumerate([3, 1, 1]):
        assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{pos}"}} {n}.0' in text
    assert 'vllm:num_requests_waiting{model_name="m"} 2.0' in text
    assert 'vllm:request_success_total{model_name="m",finished_reason="length"} 1.0' in text
    assert 'vllm:generation_tokens_total{model_name="m"} 9.0' in text


def test_plain_requests_add_no_drafts():
    m = ServerMetrics("m", block_size=4)
    m.record(GenerationResult("plain", 5, [1, 2, 3], accept_lengths=[1, 1]), "stop")
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 0.0' in m.render(0, 0)


def test_handoff_commands(tiny_qwen3_pair, tmp_path):
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.serve.handoff import handoff_command

    recipe = load_recipe(str(tiny_qwen3_pair.write_recipe(tmp_path / "r.yaml")))
    block = recipe.dflash.block_size
    vllm = handoff_command(recipe, "vllm")
    assert vllm.splitlines()[1].startswith(f"vllm serve {tiny_qwen3_pair.target_dir.resolve()}")
    assert f'"method": "dflash", "model": "{tiny_qwen3_pair.draft_dir.resolve()}"' in vllm
    assert f'"num_speculative_tokens": {block - 1}' in vllm and "--max-model-len 128" in vllm
    sglang = handoff_command(recipe, "sglang", "served")
    assert "--speculative-algorithm DFLASH" in sglang and f"--speculative-num-draft-tokens {block}" in sglang
    assert "--served-model-name served" in sglang


def test_handoff_keeps_hub_ids(tiny_qwen3_pair, tmp_path):
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.serve.handoff import handoff_command

    path = tiny_qwen3_pair.write_recipe(
        tmp_path / "r.yaml", target={"path": "Qwen/Qwen3-8B"}, dflash={"block_size": 16}
    )
    text = handoff_command(load_recipe(str(path)), "vllm")
    assert "vllm serve Qwen/Qwen3-8B" in text and '"num_speculative_tokens": 15' in text
