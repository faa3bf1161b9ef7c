"""The tests' local GCS server: ``python tests/gcs_server.py HOST PORT BUCKET`` runs the ``gcp-storage-emulator``
package's server (in memory) with two behaviours of the real service that it lacks (issue #50: the gaps named in
``docs/howto/buckets.md``), added here around its own handlers:

- **Preconditions.** An upload or delete with ``ifGenerationMatch`` (``0``: only if absent) is refused with 412
  when the object's generation differs, as GCS does; the emulator ignores the parameter and writes anyway. The run
  lock's create-if-absent and lease renewal rely on it, and so does TensorStore's OCDBT format (Orbax's
  checkpoints), which commits its manifest with a conditional write.
- **The generation of a download.** ``x-goog-generation`` (and ``x-goog-metageneration``) on a media download, as
  GCS sends them: TensorStore reads the generation of what it read from there, and without it its next
  conditional write fails ("Malformed StorageGeneration").

- **Requests served side by side** (``http.server.ThreadingHTTPServer``), as a real endpoint serves TensorStore's
  concurrent reads and writes and several processes at once; the emulator's server takes one connection at a
  time, and one client that holds its connection stalls every other. Uploads and deletes are serialised, so that a
  precondition and the write it guards are one step.

Nothing else of the emulator is changed.
"""

from __future__ import annotations

import http.server
import sys
import threading
from http import HTTPStatus

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


def _generation(storage, bucket: str, name: str) -> str:
    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return "0"


def _refused(request, response, storage, name: str | None) -> bool:
    want = request.query.get("ifGenerationMatch")
    if not want or name is None:
        return False
    if _generation(storage, request.params["bucket_name"], name) == str(want[0]):
        return False
    response.status = HTTPStatus.PRECONDITION_FAILED
    response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you specified did not hold."}})
    return True


def _upload_name(request) -> str | None:
    if "name" in request.query:
        return request.query["name"][0]
    data = request.data
    return data["meta"].get("name") if isinstance(data, dict) and isinstance(data.get("meta"), dict) else None


_WRITES = threading.Lock()  # a precondition and the write it guards: one step


def _insert(request, response, storage, *args, **kwargs):
    with _WRITES:
        if _refused(request, response, storage, _upload_name(request)):
            return None
        return _original["insert"](request, response, storage, *args, **kwargs)


def _delete(request, response, storage, *args, **kwargs):
    with _WRITES:
        if _refused(request, response, storage, request.params.get("object_id")):
            return None
        return _original["delete"](request, response, storage, *args, **kwargs)


def _download(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    except NotFound:
        pass
    return _original["download"](request, response, storage, *args, **kwargs)


_original = {"insert": objects.insert, "delete": objects.delete, "download": objects.download}
objects.insert, objects.delete, objects.download = _insert, _delete, _download  # before the server's routes are built
http.server.HTTPServer = http.server.ThreadingHTTPServer  # what the emulator's API thread builds


def main(host: str, port: int, bucket: str) -> None:
    from gcp_storage_emulator.__main__ import get_server

    server = get_server(host, port, memory=True, default_bucket=bucket)
    server.run()  # serves until the process is ended


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
