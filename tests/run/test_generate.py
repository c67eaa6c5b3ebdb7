"""`raysinga generate`: text sampled from a language model's checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TINY_JOB, TINY_LM, cli_error, load_job

from raysinga.checkpoint import Checkpoint
from raysinga.cli import main
from raysinga.nn.layers import StepContext
from raysinga.run import Trainer
from raysinga.run.generate import generate, language_model


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory) -> Checkpoint:
    cfg = load_job(tmp_path_factory.mktemp("lm"), TINY_LM)
    Trainer(cfg, log=lambda line: None).fit()
    return Checkpoint.open(cfg.checkpoint_dir + "/step-12")


def test_the_text_continues_the_prompt_with_characters_of_the_vocabulary(lm_checkpoint):
    text = generate(lm_checkpoint, "import os\n", 40, temperature=1.0, seed=3)
    assert text.startswith("import os\n") and len(text) == len("import os\n") + 40
    _, _, vocab = language_model(lm_checkpoint)
    assert set(text) <= set(vocab.chars)
    assert generate(lm_checkpoint, "import os\n", 40, temperature=1.0, seed=3) == text
    assert generate(lm_checkpoint, "import os\n", 40, temperature=1.0, seed=4) != text


def test_the_greedy_choice_is_the_likeliest_next_character(lm_checkpoint):
    net, params, vocab = language_model(lm_checkpoint)
    prompt = "def main(self):"  # 15 characters: one short of the 16-position context
    first = generate(lm_checkpoint, prompt, 1, temperature=0.0)[-1]
    x = np.zeros((1, 16), np.int64)
    x[0, :15] = vocab.encode(prompt)
    logits = net.forward(params, {}, x, StepContext(train=False))[0, 14]
    assert first == vocab.chars[int(logits.argmax())]
    long = "x = 1\n" * 10  # longer than the context: the last 16 characters count
    assert (
        generate(lm_checkpoint, long, 5, 0.0)
        == long + generate(lm_checkpoint, long[-16:], 5, 0.0)[16:]
    )


def test_the_cli_prints_the_text(lm_checkpoint, capsys):
    where = str(lm_checkpoint.location)
    assert main(["generate", where, "--prompt", "class ", "--length", "20", "--seed", "1"]) == 0
    assert capsys.readouterr().out == generate(lm_checkpoint, "class ", 20, 0.8, 1) + "\n"
    assert len(generate(lm_checkpoint, "", 7, 0.8, 1)) == 7  # from nothing: 7 characters


def test_a_checkpoint_that_is_no_language_model_is_named(tmp_path):
    cfg = load_job(tmp_path, TINY_JOB.format(name="digits"))
    Trainer(cfg, log=lambda line: None).fit()
    where = cfg.checkpoint_dir + "/step-30"
    cli_error("generate", where, named=[where, "not a language model"])
    cli_error("generate", where, "--length", "-1", named=["--length"])
