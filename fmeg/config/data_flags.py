"""Megatron's flags for the data: datasets, tokenizers, SFT and fill-in-the-middle."""

from __future__ import annotations


from fmeg.config.declare import not_positive, flag, group, switch
from fmeg.data.tokenizers import TOKENIZER_TYPES


@group("data")
class DataFlags:
    """Where samples come from and how they are tokenized and masked."""

    data_path: list[str] | None = flag(
        "--data-path", nargs="*", help="prefix, or 'weight prefix ...' (default: stdlib)"
    )
    mock_data: bool = switch(
        "--mock-data",
        help="synthetic documents (Megatron's mock dataset) instead of --data-path or the stdlib "
        "corpus",
    )
    split: str = flag(
        "--split",
        default="969,30,1",
        help="the train,valid,test weights of each dataset's documents",
    )
    tokenizer_type: str | None = flag(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        help="default: GPT2BPETokenizer with --vocab-file and --merge-file, else ByteTokenizer",
    )
    vocab_size: int | None = flag(
        "--vocab-size",
        type=int,
        help="NullTokenizer's ids in all (the last is the end of document); TikTokenizer's ids in "
        "all (default 2**17)",
    )
    tokenizer_model: str | None = flag(
        "--tokenizer-model",
        help="the tokenizer's file or directory (SentencePiece model, tiktoken JSON, Hugging Face "
        "directory)",
    )
    tiktoken_pattern: str | None = flag(
        "--tiktoken-pattern", choices=["v1", "v2"], help="TikTokenizer's pre-tokenizer regex"
    )
    tiktoken_num_special_tokens: int = flag(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="TikTokenizer: ids reserved below the vocabulary for special tokens",
    )
    tiktoken_special_tokens: list[str] | None = flag(
        "--tiktoken-special-tokens",
        nargs="+",
        help="TikTokenizer's named special tokens (default <unk> <s> </s>)",
    )
    vocab_file: str | None = flag("--vocab-file", help="GPT2BPETokenizer's vocab.json")
    merge_file: str | None = flag("--merge-file", help="GPT2BPETokenizer's merges.txt")
    eod_mask_loss: bool = switch("--eod-mask-loss", help="no loss on end-of-document tokens")
    reset_position_ids: bool = switch(
        "--reset-position-ids", help="positions restart at each document"
    )
    reset_attention_mask: bool = switch(
        "--reset-attention-mask", help="tokens attend within their own document only"
    )
    data_cache_path: str | None = flag("--data-cache-path", help="where sample indices are cached")
    num_workers: int = flag(
        "--num-workers",
        type=int,
        default=2,
        help="threads that build the next iteration's samples while a step runs (0: build them "
        "when asked)",
    )

    def problems(self) -> list[str]:
        return not_positive(self, "vocab_size")


@group("SFT and fill-in-the-middle")
class SFTFlags:
    """Conversations as samples, and FIM's rearranged documents."""

    sft: bool = switch(
        "--sft",
        help='fine-tune on JSONL conversations ({"messages": [...]} lines), trained on the '
        "answers; needs --tokenizer-type SFTTokenizer --tokenizer-model HF_DIR",
    )
    sft_tokenizer_prompt_format: str | None = flag(
        "--sft-tokenizer-prompt-format",
        help="SFTTokenizer's chat format: default (the directory's own chat template), "
        "nemotron-h-aligned, nemotron-nano-v2 or identity (the turns' texts joined)",
    )
    sft_sequence_packing: bool = switch(
        "--sft-sequence-packing",
        help="--sft: pack consecutive conversations into each sample (default: one JSONL line a "
        "sample)",
    )
    fim_data: bool = switch(
        "--fim-data",
        help="fill-in-the-middle: rearrange documents into prefix, suffix and middle (Megatron's "
        "FIM dataset)",
    )
    fim_rate: float = flag(
        "--fim-rate",
        type=float,
        default=0.5,
        help="--fim-data: the chance that a document is rearranged",
    )
    fim_spm_rate: float = flag(
        "--fim-spm-rate",
        type=float,
        default=0.5,
        help="--fim-data: the chance that a rearranged document is laid out suffix-prefix-middle",
    )
    fim_split_sample: str | None = flag(
        "--fim-split-sample",
        help="--fim-data: a token that cuts a document into fragments rearranged one by one",
    )
    fim_fragment_rate: float | None = flag(
        "--fim-fragment-rate",
        type=float,
        help="--fim-split-sample: the chance that a fragment is rearranged",
    )
    fim_no_prefix: str | None = flag(
        "--fim-no-prefix", help="--fim-data: leave documents whose text starts so alone"
    )
    fim_prefix_token: str = flag(
        "--fim-prefix-token",
        default="<fim_prefix>",
        help="--fim-data: the tokenizer's prefix token",
    )
    fim_middle_token: str = flag(
        "--fim-middle-token",
        default="<fim_middle>",
        help="--fim-data: the tokenizer's middle token",
    )
    fim_suffix_token: str = flag(
        "--fim-suffix-token",
        default="<fim_suffix>",
        help="--fim-data: the tokenizer's suffix token",
    )
    fim_pad_token: str = flag(
        "--fim-pad-token", default="<fim_pad>", help="--fim-data: the tokenizer's pad token"
    )
    fim_eod_token: str = flag(
        "--fim-eod-token", default="<|endoftext|>", help="--fim-data: the tokenizer's eod token"
    )
