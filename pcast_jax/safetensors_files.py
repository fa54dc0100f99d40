"""Safetensors files read in bounded memory: each header through :mod:`pcast_jax.fileio`'s bounded
JSON reader, its fields checked naming the field, the layout validated by the ``safetensors`` library.

:func:`tensor_files` lists a checkpoint folder's tensors (``model.safetensors``, the shards that
``model.safetensors.index.json`` maps them to, or else every ``*.safetensors`` file): a pipe or
directory given as a file, an index entry outside the folder and a tensor in two files are refused.
:func:`read_tensor` reads one F32, F16 or BF16 tensor as float32, refusing a non-finite value. Used
by the Hugging Face loader (:mod:`pcast_jax.models.hf_loader`) and by the doctor's checkpoint scales
(:func:`pcast_jax.deployments.checkpoint_scales`); every refusal is one
:class:`~pcast_jax.errors.PcastError` line naming the file, the tensor and the field.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from pcast_jax import fileio
from pcast_jax.errors import PcastError

__all__ = ["header", "tensor_files", "read_tensor", "DTYPES", "MAX_HEADER"]

#: Tensor dtypes read (little-endian; BF16 widened to float32 by hand).
DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": None}
#: Largest JSON header read (the ``safetensors`` library's own limit).
MAX_HEADER = 100 * 2**20


def header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and where its data starts, the layout validated.

    Each tensor's fields are checked here (naming the field); the ``safetensors`` library then
    validates the layout (offsets contiguous, not overlapping, inside the file; sizes that overflow).
    """
    where = f"safetensors file {path}"
    size = fileio.check_regular(path, what=where)  # a pipe is refused before it is opened for reading
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise PcastError(f"{where}: field 'header length' is truncated")
        length = int.from_bytes(head, "little")
        if length > min(size - 8, MAX_HEADER):
            raise PcastError(f"{where}: field 'header length' = {length} exceeds the file")
        head = fileio.parse_json(handle.read(length), what=f"{where}: field 'header'")
    if not isinstance(head, dict):
        raise PcastError(f"{where}: field 'header' must be a JSON object")
    for name, entry in head.items():
        if name == "__metadata__":
            continue
        at = f"{where}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise PcastError(f"{at} must be a JSON object with 'dtype', 'shape' and 'data_offsets'")
        shape, dtype, offsets = entry.get("shape"), entry.get("dtype"), entry.get("data_offsets")
        if not isinstance(dtype, str):
            raise PcastError(f"{at}: field 'dtype' = {dtype!r} must be a string (F32, F16 or BF16)")
        if not (isinstance(shape, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x
                                                for x in shape)):
            raise PcastError(f"{at}: field 'shape' = {shape!r} must be a list of integers >= 0")
        if math.prod(shape) > size:  # a value takes at least a byte
            raise PcastError(f"{at}: field 'shape' = {shape} holds more values than the file "
                             f"({size} bytes)")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)):
            raise PcastError(f"{at}: field 'data_offsets' = {offsets!r} must be two integers")
        if not 0 <= offsets[0] <= offsets[1] <= size - 8 - length:
            raise PcastError(f"{at}: field 'data_offsets' = {offsets} is not inside the file's "
                             f"{size - 8 - length} data bytes (a truncated file?)")
    _validate_layout(path, where)
    return head, 8 + length


def _validate_layout(path: Path, where: str) -> None:
    try:
        from safetensors import safe_open
    except ImportError:
        raise PcastError("reading a Hugging Face checkpoint needs the safetensors package "
                         "(pip install 'pcast_jax[model]')") from None
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except Exception as exc:  # noqa: BLE001 - the library's own error type (SafetensorError)
        raise PcastError(f"{where}: {' '.join(str(exc).split())}") from None


def _shard(folder: Path, index: Path, file) -> Path:
    """The file an index entry names, refused unless it is a plain name of a file inside ``folder``."""
    if not isinstance(file, str) or not file:
        raise PcastError(f"{index}: field 'weight_map' names {file!r}, not a file name")
    path = folder / file
    try:
        inside = path.resolve().is_relative_to(folder.resolve())
    except RuntimeError:  # a loop of symbolic links leads nowhere: said where the file is read (tensor_files)
        inside = True
    if Path(file).is_absolute() or ".." in Path(file).parts or not inside:
        raise PcastError(f"{index}: field 'weight_map' names {file!r}, outside the checkpoint folder")
    return path


def tensor_files(folder: Path, headers: dict) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it (every file's header read into ``headers``)."""
    index = folder / "model.safetensors.index.json"
    weight_map = None
    if index.exists():
        raw = fileio.load_json(index, what=f"{index}")
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise PcastError(f"{index}: field 'weight_map' is missing or not a JSON object")
        files = sorted({_shard(folder, index, file) for file in weight_map.values()})
    elif (folder / "model.safetensors").exists():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise PcastError(f"Hugging Face checkpoint {folder}: no *.safetensors file")
    out: dict[str, Path] = {}
    for file in files:
        if not file.exists():  # missing, or a symbolic link that leads nowhere (dangling, or a loop)
            named = f" (named by {index.name})" if weight_map is not None else ""
            if file.is_symlink():
                why = "it resolves to nothing"
                try:
                    os.stat(file)
                except OSError as exc:
                    why = exc.strerror or str(exc)
                raise PcastError(f"safetensors file {file}{named} is a symbolic link that leads to no file ({why})")
            raise PcastError(f"safetensors file {file}{named} does not exist")
        headers[file] = header(file)
        for name in headers[file][0]:
            if name == "__metadata__":
                continue
            if name in out:
                raise PcastError(f"Hugging Face checkpoint {folder}: tensor {name!r} is in two files, "
                                 f"{out[name].name} and {file.name}")
            out[name] = file
    if weight_map is not None:
        return {str(name): _shard(folder, index, file) for name, file in weight_map.items()}
    return out


def read_tensor(file: Path, name: str, headers: dict, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Tensor ``name`` of ``file`` (its header in ``headers``, from :func:`tensor_files`) as float32;
    ``shape``: the shape it must have (None: the header's)."""
    head, start = headers[file]
    entry = head.get(name)
    where = f"safetensors file {file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise PcastError(f"{where} is missing")
    dtype = entry["dtype"]
    if dtype not in DTYPES:
        raise PcastError(f"{where}: field 'dtype' = {dtype!r} is not read (F32, F16 or BF16)")
    if shape is None:
        shape = tuple(entry["shape"])
    if tuple(entry["shape"]) != shape:
        raise PcastError(f"{where}: field 'shape' = {entry['shape']}, expected {list(shape)}")
    offsets = entry["data_offsets"]
    itemsize = 4 if dtype == "F32" else 2
    count = math.prod(shape)
    if not (0 <= offsets[0] and offsets[1] - offsets[0] == count * itemsize
            and start + offsets[1] <= file.stat().st_size):
        raise PcastError(f"{where}: field 'data_offsets' = {offsets} does not hold {count} {dtype} values "
                         "inside the file")
    raw = np.memmap(file, dtype=np.uint8, mode="r", offset=start + offsets[0], shape=(count * itemsize,)) \
        if count else np.zeros(0, np.uint8)
    if dtype == "BF16":
        values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        values = raw.view(DTYPES[dtype]).astype(np.float32)
    if not np.all(np.isfinite(values)):
        raise PcastError(f"{where} holds a non-finite value")
    return values.reshape(shape)
