"""The one mapping from domain errors to status codes."""

from __future__ import annotations

import grpc

from kvtier.server.pool import AllocatorError
from kvtier.server.daemon.errors import (
    AlreadyExists, Cancelled, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unauthenticated,
)
from kvtier.server.service.errors import status_code_for


def test_status_codes():
    assert status_code_for(InvalidArgument("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_code_for(NotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert status_code_for(AlreadyExists("x")) == grpc.StatusCode.ALREADY_EXISTS
    assert status_code_for(ResourceExhausted("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_code_for(FailedPrecondition("x")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_code_for(Unauthenticated("x")) == grpc.StatusCode.UNAUTHENTICATED
    assert status_code_for(Cancelled("x")) == grpc.StatusCode.CANCELLED

    class TierFull(ResourceExhausted):
        pass

    assert status_code_for(TierFull("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED  # subclasses map too
    assert status_code_for(AllocatorError("double free")) == grpc.StatusCode.INVALID_ARGUMENT  # pool core ValueError
    assert status_code_for(RuntimeError("bug")) == grpc.StatusCode.INTERNAL
