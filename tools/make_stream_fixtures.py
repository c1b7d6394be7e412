"""Write the stream fixtures in data/streams/ (cache files of every tier, a cache's outputs).

The recipes live in experiments/stream_fixtures.py (kvquant_experiments.stream_fixtures);
tests/test_stream_fixtures.py writes them again and compares with these files, so that a change of the stream or file code that changes a byte
or a number fails. Run from the repository root after a deliberate format change only:

    python tools/make_stream_fixtures.py [--out data/streams]
"""
import argparse
import os

import numpy as np

import kvquant_experiments.stream_fixtures as fx


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=fx.FIXTURES)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name in list(fx.FILE_RECIPES) + list(fx.UPGRADE_RECIPES):
        path = os.path.join(args.out, name)
        if os.path.exists(path):
            os.unlink(path)
        fx.write_file(name, path)
        print(f"{path}: {os.path.getsize(path)} bytes")
    path = os.path.join(args.out, fx.CACHE_FIXTURE)
    np.savez_compressed(path, **fx.cache_outputs())
    print(f"{path}: {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
