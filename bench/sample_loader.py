"""Does a packed SFT or FIM step wait on data? The time to build one iteration's samples on the
training thread (--num-workers 0) against the time the training thread waits for them when they were
built ahead on workers while a step ran (--num-workers 2), in the same run, at the sizes of
docs/fine-tuning.md (global batch 8, micro batch 4, seq 256).

    python bench/sample_loader.py
    python bench/sample_loader.py --step-ms 100      # a shorter simulated step

Datasets: docs/fine-tuning.md's conversations (recipes.tiny_chat_model, --sft-sequence-packing)
and 20,000 small Python functions with --fim-data --fim-rate 0.9 (a byte-level tokenizer with the
FIM tokens). The step is simulated by a sleep of --step-ms (docs/fine-tuning.md's tp 2 step is
about 350 ms on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))


def build_datasets(root: Path, seq_len: int, samples: int):
    from fmeg.data.blending import build_datasets as gpt_datasets
    from fmeg.data.fim import FIM, FIMSettings
    from fmeg.data.indexed import IndexedDatasetBuilder
    from fmeg.data.sft_dataset import build_sft_datasets
    from fmeg.data.sft_tokenizer import SFTTokenizer
    from fmeg.data.tokenizers import HuggingFaceTokenizer
    from recipes import tiny_chat_model
    from test_fim import byte_tokenizer_dir

    tiny_chat_model.main(
        ["--output", str(root / "chat_model"), "--conversations", str(root / "chat.jsonl")]
    )
    chat = SFTTokenizer(str(root / "chat_model"))
    (sft, _, _), _ = build_sft_datasets(
        str(root / "chat.jsonl"),
        "100,0,0",
        seq_len,
        [samples, 0, 0],
        chat,
        cache_dir=root / "cache",
        packing=True,
    )
    code = HuggingFaceTokenizer(byte_tokenizer_dir(root / "fim_tokenizer"))
    builder = IndexedDatasetBuilder(root / "code", "uint16")
    for i in range(20000):
        builder.add_document(
            code.encode_plain(f"def f{i}(x):\n    return x * {i} + {i % 7}\n") + [code.eod]
        )
    builder.finalize()
    fim = FIM.of(FIMSettings(rate=0.9), code)
    (fim_data, _, _) = gpt_datasets(
        str(root / "code"),
        "100,0,0",
        seq_len,
        [samples, 0, 0],
        0,
        fim=fim,
        eod_id=code.eod,
        reset_position_ids=True,
        reset_attention_mask=True,
    )
    return {"sft packed": sft, "fim 0.9": fim_data}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=350.0)
    p.add_argument("--iterations", type=int, default=20)
    a = p.parse_args()
    from fmeg.config.run_config import DataConfig
    from fmeg.training.sample_loader import SampleLoader
    from fmeg.training.trainer import collate

    data = DataConfig(None, False, "100,0,0", a.seq, False, None, True, True)
    samples = a.global_batch * (a.iterations + 1)
    with tempfile.TemporaryDirectory() as tmp:
        datasets = build_datasets(Path(tmp), a.seq, samples)
        print(
            f"global batch {a.global_batch}, micro batch {a.micro_batch}, seq {a.seq}, simulated "
            f"step {a.step_ms:.0f} ms, {a.iterations} iterations"
        )
        for name, dataset in datasets.items():

            def build(ds, first):
                return collate([ds[i] for i in range(first, first + a.micro_batch)], data)

            def starts(iteration):
                return list(
                    range(
                        iteration * a.global_batch, (iteration + 1) * a.global_batch, a.micro_batch
                    )
                )

            inline = []
            for it in range(a.iterations):
                tick = time.perf_counter()
                SampleLoader(0, build).get(dataset, starts(it))
                inline.append((time.perf_counter() - tick) * 1e3)
            loader, waits = SampleLoader(2, build), []
            for it in range(a.iterations):
                tick = time.perf_counter()
                loader.get(dataset, starts(it))
                waits.append((time.perf_counter() - tick) * 1e3)
                loader.ahead(dataset, starts(it + 1))
                time.sleep(a.step_ms / 1e3)
            loader.close()
            built, waited = statistics.median(inline), statistics.median(waits[1:])
            print(
                json.dumps(
                    {
                        "dataset": name,
                        "build_ms_on_training_thread": round(built, 2),
                        "wait_ms_with_2_workers": round(waited, 3),
                        "wait_fraction_of_step_workers_0": round(built / a.step_ms, 4),
                        "wait_fraction_of_step_workers_2": round(waited / a.step_ms, 5),
                    }
                )
            )


if __name__ == "__main__":
    main()
