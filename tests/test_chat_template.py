"""The checkpoint's chat template travels into the engine folder: build-engine writes it as
chat_template.jinja, the manifest names it, and the Session hands it out."""
from __future__ import annotations

import json
import shutil

import pytest

from kiln import Session
from kiln.engines.format import read_engine_file
from kiln.models import CheckpointError, read_chat_template
from kiln.models.random_checkpoint import chat_template


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
