"""Tokenizer files made for tests: GPT-2 BPE vocab and merges (bpe_files), a Hugging Face
tokenizer directory (hf_tokenizer_dir)."""

import json


def bpe_files(tmp_path):
    from tokenizers import pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["he"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\n")
    return tmp_path / "vocab.json", tmp_path / "merges.txt"


def hf_tokenizer_dir(directory, style: str) -> str:
    """A small byte-level BPE saved as Llama 3's (<|begin_of_text|> added in front, <|end_of_text|>
    the end of document) or Qwen's (no BOS, <|endoftext|> the end of document, chat tokens)
    tokenizer.json and tokenizer_config.json, trained here on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
        if style == "llama3"
        else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [f"def f{i}(x):\n    return x * {i}  # the quick brown fox" for i in range(300)],
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    if style == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
        )
    path = directory / style
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    eos = "<|end_of_text|>" if style == "llama3" else "<|endoftext|>"
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos,
                **({"bos_token": "<|begin_of_text|>"} if style == "llama3" else {}),
            }
        )
    )
    return str(path)
