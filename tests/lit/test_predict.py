"""aah predict end to end: prompts file -> JSON Lines, the val/sample tag, sharding, and every bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch

from aah_lightning.cli import main
from aah_lightning.data import prompts as prompt_data
from aah_lightning.data.tokenizers import ByteTokenizer
from aah_lightning.errors import ConfigError
from helpers.cli import cli_error, run_tool, tiny_config, train_tiny
from helpers.modules import module_of
from helpers.tb import read_events

CORPUS = "def add(a, b):\n    return a + b\n\nclass Point:\n    x = 0\n" * 40


@pytest.fixture
def text_config(tmp_path):
    """A tiny model on a small text file with the byte tokenizer (tiny_config's model, T=32)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)

    def make(**data):
        return tiny_config(
            tmp_path,
            data={"source": "files", "files": {"paths": [str(corpus)]}, "batch_size": 2, **data},
        )

    return make


def write_prompts(path, lines) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def predict(config, *extra):
    main(["predict", "--config", config, *extra])


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_fit_logs_val_sample_then_predict_writes_jsonl(tmp_path, text_config, capsys):
    config = text_config()
    logger = [
        "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
        f"--trainer.logger.save_dir={tmp_path}/tb",
        "--sample.prompt=def ",
        "--sample.max_new_tokens=6",
    ]
    main(["fit", "--config", config, *logger])
    samples = read_events(f"{tmp_path}/tb")["text"]["val/sample/text_summary"]
    assert [e.step for e in samples] == [2, 4]  # every validation (val_check_interval=2, max_steps=4)
    text = samples[-1].tensor_proto.string_val[0].decode()
    assert text.startswith("    def ")

    prompts = write_prompts(tmp_path / "prompts.txt", ["def add(", "", "class Point:\n"[:-1] + "  # a longer prompt"])
    out = tmp_path / "out.jsonl"
    predict(
        config,
        f"--ckpt_path={tmp_path}/ckpts/last.ckpt",
        f"--data.prompts={prompts}",
        f"--generate.output={out}",
        "--generate.max_new_tokens=7",
        "--generate.temperature=0",
    )
    rows = read_jsonl(out)
    assert [r["index"] for r in rows] == [0, 1]  # blank lines are not prompts
    assert rows[0]["prompt"] == "def add(" and rows[1]["prompt"].startswith("class Point:")
    tok = ByteTokenizer()
    for row in rows:
        assert row["prompt_tokens"] == len(tok.encode(row["prompt"])) and row["prompt_tokens_dropped"] == 0
        assert row["completion_tokens"] <= 7 and row["stop"] in ("eod", "length")
        assert row["stop"] == "eod" or row["completion_tokens"] == 7
        assert row["settings"] == {
            "max_new_tokens": 7,
            "temperature": 0.0,
            "top_k": 0,
            "top_p": 1.0,
            "seed": 0,
            "stop_at_eod": True,
        }
    # Greedy through Lightning = greedy from the checkpoint's weights directly (batch of 2 with unequal prompts).
    from aah_lightning.model.generate import GenerationConfig, generate

    ckpt = torch.load(f"{tmp_path}/ckpts/last.ckpt", weights_only=True)
    module = module_of(ckpt)
    ids = [[256, *tok.encode(r["prompt"]).tolist()] for r in rows]
    direct = generate(module.model.eval(), ids[1:], GenerationConfig(max_new_tokens=7, temperature=0), 256)
    assert tok.decode(direct[0].tokens) == rows[1]["completion"]

    # The quick form: same checkpoint, same greedy continuation; a bad setting is one line and exit code 2.
    capsys.readouterr()
    ckpt = f"{tmp_path}/ckpts/last.ckpt"
    assert run_tool("generate", ckpt, "--prompt", "def add(", "--max-new-tokens=7", "--temperature=0") == 0
    out, err = capsys.readouterr()
    assert out == "def add(" + rows[0]["completion"] + "\n" and "KV cache" in err
    assert run_tool("generate", ckpt, "--top-p=0") == 2
    assert capsys.readouterr().err.strip() == "generate: error: --top-p=0.0 is not allowed: in (0, 1] (1 = off)"


def test_jsonl_prompts_hf_tokenizer_and_long_prompts(tmp_path, text_config):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([CORPUS] * 5, trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    config = text_config(tokenizer=str(tmp_path / "tokenizer.json"))
    prompts = tmp_path / "prompts.jsonl"
    long = "return a + b " * 30  # far more than seq_len=32 tokens
    prompts.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(["def", long, "class"])))
    out = tmp_path / "out.jsonl"
    with pytest.warns(UserWarning, match="prompt 1 has .* tokens, more than data.seq_len=32"):
        predict(
            config,
            f"--data.prompts={prompts}",
            f"--generate.output={out}",
            "--generate.max_new_tokens=5",
            "--generate.seed=3",
            "--generate.top_k=20",
            "--generate.stop_at_eod=false",
        )
    rows = read_jsonl(out)
    assert [r["prompt"] for r in rows] == ["def", long, "class"]
    assert [r["completion_tokens"] for r in rows] == [5, 5, 5]
    assert rows[1]["prompt_tokens"] == 31 and rows[1]["prompt_tokens_dropped"] > 0
    assert rows[1]["prompt_tokens"] + rows[1]["prompt_tokens_dropped"] == len(tok.encode(long).ids)
    # Same seed, same completions, whatever the batch size.
    out2 = tmp_path / "out2.jsonl"
    predict(
        config,
        f"--data.prompts={prompts}",
        f"--generate.output={out2}",
        "--generate.max_new_tokens=5",
        "--generate.seed=3",
        "--generate.top_k=20",
        "--generate.stop_at_eod=false",
        "--data.batch_size=1",
    )
    assert [r["completion"] for r in read_jsonl(out2)] == [r["completion"] for r in rows]


def test_ranks_share_the_prompts_out():
    for n, world in [(7, 3), (2, 4), (8, 2)]:
        shards = [prompt_data.shard(n, rank, world) for rank in range(world)]
        flat = sorted(i for s in shards for i in s)
        assert flat == list(range(n))  # disjoint and complete
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
    texts = [f"prompt {i}" for i in range(5)]
    sets = [prompt_data.PromptSet(texts, ByteTokenizer(), 32, rank, 2) for rank in range(2)]
    assert [item["index"] for item in sets[1]] == [1, 3]
    assert [item["text"] for item in sets[0]] == ["prompt 0", "prompt 2", "prompt 4"]


def test_prompt_files_are_checked():
    with pytest.raises(ConfigError, match="data.prompts is not set"):
        prompt_data.read_prompts(None)


@pytest.mark.parametrize(
    "case, words",
    [
        ("empty", "holds no prompts"),
        ("missing", "does not exist"),
        ("bad_json", "line 2 has no string field 'prompt'"),
        ("temperature", "generate.temperature=-1.0 is not allowed"),
        ("top_p", "generate.top_p=0.0 is not allowed"),
        ("top_k", "generate.top_k=-2 is not allowed"),
        ("max_new_tokens", "generate.max_new_tokens=0 is not allowed"),
        ("no_folder", "the folder"),
        ("output_is_folder", "is a folder"),
        ("other_shape", "holds a model with model.gpt.vocab_size=65"),
        ("synthetic", "aah predict needs a text tokenizer, and data.source='synthetic' has none"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, text_config, capsys, case, words):
    # With the logger of a real run: every refusal comes before the Trainer starts, where the logger makes its folder.
    config = text_config()
    prompts = write_prompts(tmp_path / "p.txt", ["def f("])
    out = tmp_path / "out.jsonl"
    args = {"prompts": f"--data.prompts={prompts}", "output": f"--generate.output={out}"}
    extra = []
    if case == "empty":
        args["prompts"] = f"--data.prompts={write_prompts(tmp_path / 'e.txt', ['', '  '])}"
    elif case == "missing":
        args["prompts"] = f"--data.prompts={tmp_path / 'nope.txt'}"
    elif case == "bad_json":
        (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
        args["prompts"] = f"--data.prompts={tmp_path / 'p.jsonl'}"
    elif case in ("temperature", "top_p", "top_k", "max_new_tokens"):
        extra = [
            f"--generate.{case}=" + {"temperature": "-1.0", "top_p": "0.0", "top_k": "-2", "max_new_tokens": "0"}[case]
        ]
    elif case == "no_folder":
        out = tmp_path / "nowhere" / "out.jsonl"
        args["output"] = f"--generate.output={out}"
    elif case == "output_is_folder":
        out = tmp_path / "folder"
        out.mkdir()
        args["output"] = f"--generate.output={out}"
    elif case == "other_shape":
        ckpts = train_tiny(tmp_path / "synthetic")  # vocabulary 65: the byte tokenizer needs 257
        extra = [f"--ckpt_path={ckpts}/last.ckpt"]
    elif case == "synthetic":
        extra = ["--data.source=synthetic"]
    logger = [
        "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
        f"--trainer.logger.save_dir={tmp_path}/tb",
    ]
    before = sorted(tmp_path.rglob("*"))
    code, line = cli_error(["predict", "--config", config, *args.values(), *extra, *logger], capsys)
    assert code == 2 and line.startswith("aah: error:") and words in line, line
    assert sorted(tmp_path.rglob("*")) == before  # no output, no temporary file, no log folder


def test_the_output_file_has_the_mode_a_plain_open_gives_or_the_one_it_replaces(tmp_path):
    from aah_lightning.lit.generation import write_jsonl

    umask = os.umask(0o022)
    try:
        out = tmp_path / "new.jsonl"
        write_jsonl(str(out), [{"index": 0}])
        assert os.stat(out).st_mode & 0o777 == 0o644  # not mkstemp's 0600
        kept = tmp_path / "kept.jsonl"
        kept.write_text("old\n")
        os.chmod(kept, 0o640)
        write_jsonl(str(kept), [{"index": 1}])
        assert os.stat(kept).st_mode & 0o777 == 0o640 and kept.read_text() == '{"index": 1}\n'
    finally:
        os.umask(umask)
