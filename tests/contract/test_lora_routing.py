"""LoRA routing through a real Scheduler gRPC server over a real Redis: an adapter's requests
go only to workers that announced it (WorkerInfo.loras), and a worker that re-registers with
a changed adapter list is routed by the new one."""

from __future__ import annotations

import grpc
import pytest
from test_scheduler_service import (  # noqa: F401 (a fixture)
    BLOCK,
    MODEL,
    NS,
    RouteSessionClient,
    load,
    route_request,
    start_replica,
)

from meshserve.proto.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from meshserve.shared.errors import MeshError
from meshserve.shared.lora_config import lora_id_for
from meshserve.shared.status import grpc_code_for

SQL = lora_id_for("sql")


async def register(stub: scheduler_pb2_grpc.SchedulerStub, worker_id: str,
                   adapters: list[str]) -> None:
    info = common_pb2.WorkerInfo(
        worker_id=worker_id, epoch=1, address=f"{worker_id}:1", model_names=[MODEL],
        block_size=BLOCK, kv_namespace=NS, lora_ids=[lora_id_for(a) for a in adapters],
        loras=[common_pb2.LoraAdapter(name=a, id=lora_id_for(a), base_model_name=MODEL)
               for a in adapters])
    await stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(info=info,
                                                                  load=load(worker_id)))


async def picks(session: RouteSessionClient, count: int, **fields: object) -> list[str]:
    """The workers `count` routes go to, each released at once."""
    chosen = []
    for i in range(count):
        response = await session.route(route_request(f"r{i}-{fields}", **fields))
        session.release(f"r{i}-{fields}", response.worker_id)
        chosen.append(response.worker_id)
    return chosen


async def test_adapter_requests_go_to_the_workers_that_have_it(start_replica) -> None:  # noqa: F811
    replica = await start_replica(routing="round-robin")
    await register(replica.stub, "w0", [])
    await register(replica.stub, "w1", ["sql"])
    session = RouteSessionClient(replica.stub)
    # Round-robin alternates base-model requests, but the adapter's only reach w1.
    assert set(await picks(session, 4)) == {"w0", "w1"}
    assert await picks(session, 6, lora_id=SQL) == ["w1"] * 6
    listed = await replica.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
    adapters = {w.info.worker_id: [(a.name, a.id, a.base_model_name) for a in w.info.loras]
                for w in listed.workers}
    assert adapters == {"w0": [], "w1": [("sql", SQL, MODEL)]}
    # w0 loads it too (re-registering with the same epoch): both take it now.
    await register(replica.stub, "w0", ["sql"])
    assert set(await picks(session, 4, lora_id=SQL)) == {"w0", "w1"}
    # w1 unloads it: only w0 is left for it.
    await register(replica.stub, "w1", [])
    assert await picks(session, 3, lora_id=SQL) == ["w0"] * 3
    await session.close()


async def test_an_adapter_no_worker_has_is_not_found(start_replica) -> None:  # noqa: F811
    replica = await start_replica()
    await register(replica.stub, "w0", ["sql"])
    session = RouteSessionClient(replica.stub)
    with pytest.raises(MeshError) as failed:
        await session.route(route_request("x", lora_id=lora_id_for("other")))
    assert grpc_code_for(failed.value) == grpc.StatusCode.NOT_FOUND
    assert "LoRA adapter" in failed.value.message
    await session.close()
