"""Write examples/parquet/*.parquet from examples/text: one document per paragraph.

    uv run python examples/parquet/make_parquet.py

Each file holds a `text` column, as a downloaded Hugging Face text dataset does.
A pre-tokenized dataset holds a list-of-integers column instead (e.g. `input_ids`);
`train_data_columns` names whichever the files have.
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).parent


def paragraphs(path: Path) -> list[str]:
    return [p.strip() for p in path.read_text().split("\n\n") if p.strip()]


def main() -> None:
    for name in ("train", "held_out"):
        table = pa.table({"text": paragraphs(HERE.parent / "text" / f"{name}.txt")})
        pq.write_table(table, HERE / f"{name}.parquet", compression="zstd")


if __name__ == "__main__":
    main()
