"""Damaging a built litdata corpus the way a cut-short copy or a bad disk would."""


def damage_chunk_header(split_dir) -> str:
    """Overwrite two item offsets of the first chunk, keeping its size."""
    chunk = min(split_dir.glob("chunk-*.bin"))
    data = bytearray(chunk.read_bytes())
    data[12:20] = b"\xff" * 8
    chunk.write_bytes(bytes(data))
    return chunk.name
