"""The checkpoint's chat template travels into the engine folder: build-engine writes it as
chat_template.jinja, the manifest names it, and the Session hands it out; rendering it gives
what transformers' apply_chat_template gives (text and token ids), and Session.chat and
run-engine --chat generate from it."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from kiln import SamplingParams, Session
from kiln.engines.format import read_engine_file
from kiln.models import CheckpointError, read_chat_template
from kiln.models.random_tokenizer import chat_template
from kiln.runtime.chat_template import ChatTemplateError
from kiln.runtime.cli import run_engine

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " What is a kiln? \n"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Un café, s'il vous plaît — 東京?"}],
    [{"role": "system", "content": "x"}, {"role": "user", "content": ""}, {"role": "assistant", "content": "y",
                                                                            "name": None}],
]


def test_engine_carries_the_checkpoints_template(factory):
    engine = factory.engine(factory.checkpoint("llama3"), dtype="float32")
    assert read_engine_file(engine / "rank0.engine", verify=False).manifest.chat_template_file == "chat_template.jinja"
    assert (engine / "chat_template.jinja").read_text() == chat_template("llama3")
    with Session(engine) as session:
        assert session.chat_template == chat_template("llama3")


def test_without_a_template_the_engine_has_none(factory, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(factory.checkpoint("qwen2"), ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    engine = factory.engine(ckpt, dtype="float32")
    assert not (engine / "chat_template.jinja").exists()
    with Session(engine) as session:
        assert session.chat_template is None
        with pytest.raises(ChatTemplateError, match="has no chat template .* send a plain prompt instead"):
            session.chat([{"role": "user", "content": "Hi"}])
    result = CliRunner().invoke(run_engine, ["--engine", str(engine), "--chat", "Hi"])
    assert result.exit_code == 1 and "has no chat template" in result.output


def test_where_a_checkpoints_template_is_found(tmp_path):
    assert read_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert read_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert read_chat_template(tmp_path) == "J"  # the file wins, as in transformers
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json is not valid JSON"):
        read_chat_template(tmp_path)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "mistral"])
def test_rendering_equals_transformers_apply_chat_template(factory, family):
    ckpt = factory.checkpoint(family)
    reference = AutoTokenizer.from_pretrained(ckpt)
    with Session(factory.engine(ckpt, dtype="float32")) as session:
        for conversation in CONVERSATIONS:
            for generation_prompt in (True, False):
                want = reference.apply_chat_template(conversation, tokenize=False,
                                                     add_generation_prompt=generation_prompt)
                assert session.apply_chat_template(conversation, generation_prompt) == want
                ids = reference(want, add_special_tokens=False)["input_ids"]
                assert session.apply_chat_template(conversation, generation_prompt, tokenize=True) == ids
                assert ids == reference.apply_chat_template(conversation, add_generation_prompt=generation_prompt,
                                                            tokenize=True, return_dict=True)["input_ids"]


def test_special_tokens_reach_the_template_as_tokens(factory):
    with Session(factory.engine(factory.checkpoint("llama3"), dtype="float32")) as session:
        ids = session.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
        header = session.tokenizer.token_to_id("<|start_header_id|>")
        assert ids[0] == session.tokenizer.token_to_id("<s>") and ids[1] == header and ids.count(header) == 2


@pytest.mark.parametrize("messages, message", [
    ([{"role": "tool", "content": "42"}], "refused by the engine's chat template: Conversation roles must be system, "
                                          "user or assistant, not tool"),
    ([], "messages is empty"),
    ("Hello", "must be a list of messages"),
    ([{"content": "Hi"}], r"\[0\] needs a 'role' string"),
    ([{"role": "user"}], r"\[0\] \(user\) has no 'content'"),
])
def test_bad_conversations_are_refused_by_name(factory, messages, message):
    with Session(factory.engine(factory.checkpoint("llama3"), dtype="float32")) as session:
        with pytest.raises(ValueError, match=message) as e:
            session.apply_chat_template(messages)
        assert e.value.argument == "messages"


def test_session_chat_generates_from_the_rendered_conversation(factory):
    ckpt = factory.checkpoint("qwen2")
    reference = AutoTokenizer.from_pretrained(ckpt)
    params = SamplingParams(temperature=0, max_tokens=8)
    with Session(factory.engine(ckpt, dtype="float32")) as session:
        ids = [reference.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for c in CONVERSATIONS[:2]]
        want = session.generate(prompt_token_ids=ids, sampling_params=params)
        one = session.chat(CONVERSATIONS[0], params)
        both = session.chat(CONVERSATIONS[:2], params)
    assert [o.prompt_token_ids for o in both] == ids
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in want]
    assert one[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_run_engine_chat_prints_session_chats_answer(factory):
    engine = factory.engine(factory.checkpoint("llama3"), dtype="float32")
    with Session(engine) as session:
        out = session.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a kiln?"}],
                           SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    result = CliRunner().invoke(run_engine, ["--engine", str(engine), "--chat", "What is a kiln?", "--system",
                                             "Be brief.", "--max-tokens", "10"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"What is a kiln?{out.text}  [{out.finish_reason}]\n"
    result = CliRunner().invoke(run_engine, ["--engine", str(engine), "--system", "Be brief.", "--prompt", "Hi"])
    assert result.exit_code == 2 and "--system starts a --chat conversation" in result.output
