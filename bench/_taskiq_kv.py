"""A taskiq result backend on a JetStream key-value bucket (the taskiq peer's; needs taskiq).

taskiq-nats ships one result backend, ``NATSObjectStoreResultBackend``; every read of it
(``is_ready`` and ``get_result`` alike) creates an ordered JetStream consumer on the object
store's stream, alive for seconds after the read. With 64 workflows in flight and a caller
polling for results, the live consumers reach the server's limit within a second and reads fail
with ``maximum consumers limit reached`` (err_code 10026). This backend keeps taskiq's own
contract (the worker writes the result, the caller polls for it) on a KV bucket instead: one
``put`` per result, one direct ``get`` per poll; file storage, R1, history 1, no age limit.
"""

from __future__ import annotations

from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue
from taskiq import AsyncResultBackend, ResultGetError
from taskiq.result import TaskiqResult
from taskiq.serializers import JSONSerializer

__all__ = ["KvResultBackend"]


class KvResultBackend(AsyncResultBackend[Any]):
    """Results of tasks as JSON in the JetStream KV bucket ``bucket``, keyed by task id."""

    def __init__(self, url: str, bucket: str) -> None:
        self.url = url
        self.bucket = bucket
        self.serializer = JSONSerializer()
        self._nc: NATS | None = None
        self._kv: KeyValue | None = None

    async def startup(self) -> None:
        self._nc = await nats.connect(self.url, name="bench-taskiq-results")
        js = self._nc.jetstream()
        try:
            self._kv = await js.key_value(self.bucket)
        except BucketNotFoundError:
            self._kv = await js.create_key_value(
                KeyValueConfig(bucket=self.bucket, history=1, storage=StorageType.FILE, direct=True)
            )

    async def shutdown(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()

    @property
    def kv(self) -> KeyValue:
        if self._kv is None:
            raise RuntimeError("result backend is not started")
        return self._kv

    async def set_result(self, task_id: str, result: TaskiqResult[Any]) -> None:
        await self.kv.put(task_id, self.serializer.dumpb(result.model_dump(mode="json")))

    async def is_result_ready(self, task_id: str) -> bool:
        try:
            await self.kv.get(task_id)
        except KeyNotFoundError:
            return False
        return True

    async def get_result(self, task_id: str, with_logs: bool = False) -> TaskiqResult[Any]:
        try:
            entry = await self.kv.get(task_id)
        except KeyNotFoundError as err:
            raise ResultGetError from err
        result: TaskiqResult[Any] = TaskiqResult[Any].model_validate(
            self.serializer.loadb(entry.value or b"null")
        )
        if not with_logs:
            result.log = None
        return result
