"""``mpipar prepare-data``: build the byte-level standard-library corpus (or a synthetic token
set) as an HDF5 token file and print its stats, including the unigram baseline loss."""

from __future__ import annotations

import math
import sys
import time

HELP = "build the token file: Python stdlib byte corpus (default) or a synthetic set"


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="output file (default: data/stdlib_corpus.h5 in the checkout, else "
                             "~/.cache/mpipar/; synthetic: synthetic_<kind>.h5 beside it)")
    parser.add_argument("--max-bytes", type=int, default=16 * 2**20, metavar="N",
                        help="cap on corpus bytes, train + val (default 16 MiB)")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="share of files (corpus) or tokens (synthetic) held out (default 0.1)")
    parser.add_argument("--source-dir", default=None, metavar="DIR",
                        help="read *.py files from DIR instead of the standard library")
    parser.add_argument("--include-tests", action="store_true",
                        help="also take the standard library's test folders")
    parser.add_argument("--synthetic", default=None, metavar="KIND",
                        choices=("pattern", "markov", "uniform"),
                        help="make a synthetic set instead: pattern | markov | uniform")
    parser.add_argument("--tokens", type=int, default=100_000, metavar="N",
                        help="synthetic: number of tokens (default 100000)")
    parser.add_argument("--vocab", type=int, default=64, help="synthetic: vocabulary (default 64)")
    parser.add_argument("--noise", type=float, default=0.1,
                        help="synthetic pattern: probability a token is random (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic: seed (default 0)")


def run(args) -> int:
    from mpipar import datasets

    t0 = time.perf_counter()
    try:
        if args.synthetic:
            out = args.out or datasets.default_corpus_path().with_name(
                f"synthetic_{args.synthetic}.h5")
            stats = datasets.prepare_synthetic(out, args.synthetic, args.tokens, args.vocab,
                                               args.seed, val_fraction=args.val_fraction,
                                               noise=args.noise)
        else:
            out = args.out or datasets.default_corpus_path()
            stats = datasets.prepare_corpus(out, source_dir=args.source_dir,
                                            val_fraction=args.val_fraction,
                                            max_bytes=args.max_bytes,
                                            include_tests=args.include_tests)
    except (ValueError, OSError) as exc:
        print(f"mpipar prepare-data: error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - t0

    print(f"wrote {stats['path']} in {seconds:.2f} s")
    print(f"  kind            {stats['kind']}")
    print(f"  source          {stats['source']}")
    if stats.get("n_files"):
        print(f"  files           {stats['n_files']} ({stats['n_train_files']} train, "
              f"{stats['n_val_files']} val)")
    print(f"  tokens          train {stats['n_train']:,}  val {stats['n_val']:,}  "
          f"vocab {stats['vocab_size']}")
    print(f"  unigram val loss {stats['unigram_val_loss']:.4f} nats/token "
          f"(uniform {math.log(stats['vocab_size']):.4f}): a model must beat this to use context")
    if "entropy_rate" in stats:
        print(f"  entropy rate    {stats['entropy_rate']:.4f} nats/token (best reachable loss)")
    print(f"  sha256          {stats['sha256']}")
    return 0
