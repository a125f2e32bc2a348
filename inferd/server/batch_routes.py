"""The OpenAI Batch API on ``inferd serve``: ``/v1/files`` and ``/v1/batches``.

Files and jobs live under ``<data_dir>/batch`` (``inferd.batch.store``) and
survive restarts; one ``BatchWorker`` runs the jobs on this server's engine,
below interactive requests (``inferd.batch.worker``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse

from inferd.batch.store import BatchRecord, BatchStore, default_data_dir
from inferd.batch.upload import FileTooLarge, InvalidFile
from inferd.batch.worker import BatchWorker
from inferd.server import errors
from inferd.server.batch_protocol import BatchList, BatchObject, CreateBatchRequest, FileDeleted, FileList, FileObject
from inferd.server.config import ServerConfig
from inferd.server.errors import APIError
from inferd.server.protocol import ErrorResponse
from inferd.server.serving import OpenAIServing

logger = logging.getLogger("inferd.batch")

FILES_PATH = "/v1/files"
# Room for the multipart framing around a file of max_file_bytes.
_MULTIPART_SLACK = 64 * 1024
_ERRORS = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    404: {"model": ErrorResponse, "description": "No such file or batch"},
}
_CONFLICT = {**_ERRORS, 409: {"model": ErrorResponse, "description": "Not in a state that allows it"}}
_TOO_LARGE = {**_ERRORS, 413: {"model": ErrorResponse, "description": "File too large"}}


class BatchAPI:
    """The store, opened on first use (a server that never sees the Batch
    API writes nothing to its data dir), and its worker, started once both
    the store and the engine are there."""

    def __init__(self, config: ServerConfig) -> None:
        self.root = Path(config.data_dir).expanduser() if config.data_dir else default_data_dir()
        self.root = self.root / "batch"
        self.max_file_bytes = config.max_file_bytes
        self.worker: BatchWorker | None = None
        self._store: BatchStore | None = None
        self._serving: OpenAIServing | None = None
        self._max_in_flight = 1

    @property
    def store(self) -> BatchStore:
        if self._store is None:
            self._store = BatchStore(self.root)
            self._start_worker()
        return self._store

    def attach(self, serving: OpenAIServing, max_num_seqs: int) -> None:
        """Runs jobs on ``serving`` (call on the event loop), resuming those a
        restart cut; half the engine's seats at most, so interactive requests find some."""
        self._serving = serving
        self._max_in_flight = max(1, max_num_seqs // 2)
        if (self.root / "batch.db").exists():
            try:
                _ = self.store
            except Exception:  # noqa: BLE001 - interactive serving goes on; the batch routes answer 500
                logger.exception("the Batch API's store in %s cannot be opened", self.root)
        self._start_worker()

    def _start_worker(self) -> None:
        if self.worker is None and self._store is not None and self._serving is not None:
            self.worker = BatchWorker(self._store, self._serving, self._max_in_flight)
            self.worker.start()

    async def close(self) -> None:
        if self.worker is not None:
            await self.worker.stop()
        if self._store is not None:
            self._store.close()

    def batch(self, batch_id: str) -> BatchRecord:
        record = self.store.get_batch(batch_id)
        if record is None:
            raise _not_found(f"No such Batch object: {batch_id}", "batch_id")
        return record

    def cancel(self, batch_id: str) -> BatchRecord:
        batch = self.batch(batch_id)
        if batch.status in ("cancelling", "cancelled"):
            return batch
        if batch.status not in ("validating", "in_progress"):
            raise APIError(409, f"batch {batch_id} is {batch.status} and cannot be cancelled", code="batch_not_cancellable")
        # Cancelled once the server that runs the jobs sees it: at once when
        # that is this one, else within a second (or when one starts).
        self.store.set_status(batch_id, "cancelling")
        if self.worker is not None:
            self.worker.sweep()
        return self.batch(batch_id)


def _not_found(message: str, param: str) -> APIError:
    return APIError(404, message, type="not_found_error", param=param)


def _page(items: list, has_more: bool, model: type) -> dict:
    return model(data=items, first_id=items[0]["id"] if items else None,
                 last_id=items[-1]["id"] if items else None, has_more=has_more).model_dump()  # fmt: skip


def batch_router(api: BatchAPI) -> APIRouter:
    router = APIRouter(tags=["batch"])

    @router.post(FILES_PATH, response_model=FileObject, responses=_TOO_LARGE)
    async def create_file(file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]) -> dict:
        if purpose != "batch":
            raise errors.bad_request(f"purpose must be 'batch' (this server stores files for the Batch API), got {purpose!r}",
                                     param="purpose")  # fmt: skip
        store = api.store
        try:
            record = await asyncio.to_thread(store.add_upload, file.file, file.filename or "batch.jsonl", api.max_file_bytes)
        except FileTooLarge as e:
            raise APIError(413, str(e), param="file", code="file_too_large") from None
        except InvalidFile as e:
            raise errors.bad_request(str(e), param="file", code="invalid_file") from None
        return record.to_openai()

    @router.get(FILES_PATH, response_model=FileList, responses=_ERRORS)
    async def list_files(
        purpose: str | None = None,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict:
        try:
            records, more = api.store.list_files(purpose, after, limit, ascending=order == "asc")
        except KeyError:
            raise errors.bad_request(f"after: no file {after}", param="after") from None
        return _page([r.to_openai() for r in records], more, FileList)

    def file_record(file_id: str):  # noqa: ANN202
        record = api.store.get_file(file_id)
        if record is None:
            raise _not_found(f"No such File object: {file_id}", "file_id")
        return record

    @router.get(FILES_PATH + "/{file_id}", response_model=FileObject, responses=_ERRORS)
    async def retrieve_file(file_id: str) -> dict:
        return file_record(file_id).to_openai()

    @router.get(FILES_PATH + "/{file_id}/content", responses={**_ERRORS, 200: {"content": {"application/octet-stream": {}}}})
    async def file_content(file_id: str) -> FileResponse:
        record = file_record(file_id)
        path = api.store.content_path(record)
        if not path.exists():
            raise _not_found(f"the content of file {file_id} is gone from the data directory", "file_id")
        return FileResponse(path, media_type="application/octet-stream", filename=record.filename)

    @router.delete(FILES_PATH + "/{file_id}", response_model=FileDeleted, responses=_CONFLICT)
    async def delete_file(file_id: str) -> dict:
        file_record(file_id)
        users = api.store.inputs_in_use(file_id)
        if users:
            raise APIError(409, f"file {file_id} is the input of batch {users[0]}, which has not ended; cancel it first",
                           param="file_id", code="file_in_use")  # fmt: skip
        api.store.delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @router.post("/v1/batches", response_model=BatchObject, responses=_ERRORS)
    async def create_batch(body: CreateBatchRequest) -> dict:
        if body.endpoint == "/v1/embeddings":
            raise errors.bad_request("endpoint /v1/embeddings: embeddings are not served yet", param="endpoint")
        record = api.store.get_file(body.input_file_id)
        if record is None:
            raise _not_found(f"No such File object: {body.input_file_id}", "input_file_id")
        if record.purpose != "batch":
            raise errors.bad_request(f"input_file_id: file {record.id} has purpose {record.purpose!r}, not 'batch'",
                                     param="input_file_id")  # fmt: skip
        batch = api.store.create_batch(record.id, body.endpoint, body.metadata)
        if api.worker is not None:
            api.worker.wake()
        return batch.to_openai()

    @router.get("/v1/batches", response_model=BatchList, responses=_ERRORS)
    async def list_batches(after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict:
        try:
            records, more = api.store.list_batches(after, limit)
        except KeyError:
            raise errors.bad_request(f"after: no batch {after}", param="after") from None
        return _page([r.to_openai() for r in records], more, BatchList)

    @router.get("/v1/batches/{batch_id}", response_model=BatchObject, responses=_ERRORS)
    async def retrieve_batch(batch_id: str) -> dict:
        return api.batch(batch_id).to_openai()

    @router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject, responses=_CONFLICT)
    async def cancel_batch(batch_id: str) -> dict:
        return api.cancel(batch_id).to_openai()

    return router


def upload_limits(max_body_bytes: int, max_file_bytes: int) -> dict[str, int]:
    """``RequestContextMiddleware``'s body limit for ``POST /v1/files``:
    ``max_file_bytes`` plus the multipart framing (the route checks the
    file's exact size)."""
    return {FILES_PATH: max(max_body_bytes, max_file_bytes + _MULTIPART_SLACK)}
