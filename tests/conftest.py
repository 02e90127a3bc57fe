"""Tiny models built in seconds for the test-suite."""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile

import pytest
import torch

# the commands write their runs into a results store: each test process gets its own, never the user's
os.environ["ASTRL_STORE"] = tempfile.mkdtemp(prefix="astrl-store-")
atexit.register(shutil.rmtree, os.environ["ASTRL_STORE"], ignore_errors=True)  # removed when the process ends

if os.environ.get("PYTEST_XDIST_WORKER"):  # one torch thread per test worker: the workers share the cores
    torch.set_num_threads(1)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "hello how are you today what is the weather like i am fine thanks tell me about your day "
    "damn hell you idiot nice good bad the cat dog walk park music food friend work home"
).split()


def make_tokenizer(vocab_size: int = 320, seed: int = 0, byte_level: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(300)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    fast.chat_template = CHATML
    return fast


def make_llama(tokenizer, *, max_positions: int = 512, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return LlamaForCausalLM(config).eval()


def make_gpt2(tokenizer, *, n_positions: int = 128, seed: int = 1):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config).eval()


def loaded(model, tokenizer, name: str = "tiny"):
    from astrl.models import LoadedModel, context_window, prepare_tokenizer

    prepare_tokenizer(tokenizer, model)
    return LoadedModel(name, model, tokenizer, context_window(model, tokenizer))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture()
def tiny_lm():
    tok = make_tokenizer()
    return loaded(make_llama(tok), tok)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Llama checkpoint folder, as a user's local model would be."""
    tok = make_tokenizer()
    model = make_llama(tok)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture()
def one_thread():
    """Tiny models run fastest on one thread (and do not fight other processes for cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
