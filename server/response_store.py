"""Stored Responses: what ``previous_response_id`` continues and ``GET /v1/responses/{id}`` returns.

    POST /v1/responses --ResponseStore.begin--> the body (with previous_response_id: its input is
        the stored input + the stored output + the new input; instructions and tools are not
        carried over, as in OpenAI's API) and a StoredTurn
    the finished response object --StoredTurn.finish--> stored, unless the body said "store": false
    GET /v1/responses/{id} --ResponseStore.get--> the response object as it was returned

Soft state of one coordinator (behind several, a client must reach the same one), bounded in
bytes (``server.response_store_mib``: each entry's JSON size), least recently used evicted
first. An entry holds its whole conversation, so a chain of turns costs the sum of its prefixes.
Used on the event loop only.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from deepinfer.server.errors import ApiError, bad_request


@dataclass(frozen=True)
class _Entry:
    input_items: list[Any]  # the request's input as a list of items, its predecessors' included
    response: dict[str, Any]
    num_bytes: int


@dataclass
class StoredTurn:
    """One Responses request's part in the store. Producer: ``ResponseStore.begin`` (the
    handler); consumer: ``streaming.respond``, which hands it the response objects it sends."""

    store: ResponseStore
    input_items: list[Any]
    previous_response_id: str | None
    is_stored: bool

    def echo(self, response: dict[str, Any]) -> None:
        """The request's ``previous_response_id`` on a response object (the recipe's is null)."""
        if self.previous_response_id is not None:
            response["previous_response_id"] = self.previous_response_id

    def finish(self, response: dict[str, Any]) -> None:
        self.echo(response)
        if self.is_stored:
            self.store.put(self.input_items, response)


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> dict[str, Any]:
        """The stored response; ApiError 404 when it is not (or no longer) stored."""
        return self._entry(response_id, "response_id", "Response").response

    def begin(self, body: dict[str, Any]) -> tuple[dict[str, Any], StoredTurn]:
        """The body to convert (its input prefixed with the previous response's conversation)
        and the turn to finish. Raises ApiError (400 bad id, 404 unknown)."""
        previous_id = body.get("previous_response_id")
        items = input_items(body.get("input"))
        if previous_id is not None:
            if not isinstance(previous_id, str):
                raise bad_request(
                    f"Invalid previous_response_id: expected a string, got {previous_id!r}",
                    "previous_response_id",
                )
            previous = self._entry(previous_id, "previous_response_id", "Previous response")
            items = [*previous.input_items, *previous.response.get("output", []), *items]
            body = {k: v for k, v in body.items() if k != "previous_response_id"}
            body["input"] = items
        is_stored = body.get("store") is not False and self.max_bytes > 0
        return body, StoredTurn(self, items, previous_id, is_stored)

    def put(self, input_items: list[Any], response: dict[str, Any]) -> None:
        num_bytes = len(json.dumps(input_items)) + len(json.dumps(response))
        if num_bytes > self.max_bytes:
            return
        response_id = response["id"]
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.num_bytes -= old.num_bytes
        self._entries[response_id] = _Entry(input_items, response, num_bytes)
        self.num_bytes += num_bytes
        while self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes

    def _entry(self, response_id: str, param: str, what: str) -> _Entry:
        entry = self._entries.get(response_id)
        if entry is None:
            raise ApiError(
                404,
                f"{what} with id '{response_id}' not found (responses are kept within "
                "server.response_store_mib, least recently used evicted first, unless sent "
                'with "store": false)',
                param=param,
                code="not_found",
            )
        self._entries.move_to_end(response_id)
        return entry


def input_items(value: Any) -> list[Any]:
    """A Responses ``input`` as a list of items (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return value
    raise bad_request(
        f"Invalid input: expected a string or a list of items, got {value!r}", "input"
    )
