from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StoredObject(_message.Message):
    __slots__ = ("namespace", "key", "parent", "pos", "group", "tier", "offset", "length", "sums", "seq", "layer_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    POS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    key: bytes
    parent: bytes
    pos: int
    group: int
    tier: int
    offset: int
    length: int
    sums: bytes
    seq: int
    layer_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., pos: _Optional[int] = ..., group: _Optional[int] = ..., tier: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., sums: _Optional[bytes] = ..., seq: _Optional[int] = ..., layer_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class StoredColumns(_message.Message):
    __slots__ = ("namespaces", "ns_index", "keys", "parents", "pos", "group", "tier", "offset", "length", "seq", "nsums", "sums", "nlayer_bytes", "layer_bytes")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NS_INDEX_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    POS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NSUMS_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    NLAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedScalarFieldContainer[bytes]
    ns_index: bytes
    keys: bytes
    parents: bytes
    pos: bytes
    group: bytes
    tier: bytes
    offset: bytes
    length: bytes
    seq: bytes
    nsums: bytes
    sums: bytes
    nlayer_bytes: bytes
    layer_bytes: bytes
    def __init__(self, namespaces: _Optional[_Iterable[bytes]] = ..., ns_index: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., parents: _Optional[bytes] = ..., pos: _Optional[bytes] = ..., group: _Optional[bytes] = ..., tier: _Optional[bytes] = ..., offset: _Optional[bytes] = ..., length: _Optional[bytes] = ..., seq: _Optional[bytes] = ..., nsums: _Optional[bytes] = ..., sums: _Optional[bytes] = ..., nlayer_bytes: _Optional[bytes] = ..., layer_bytes: _Optional[bytes] = ...) -> None: ...

class ReportObjectsRequest(_message.Message):
    __slots__ = ("server_id", "incarnation", "epoch", "objects", "last", "columns")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    incarnation: int
    epoch: int
    objects: _containers.RepeatedCompositeFieldContainer[StoredObject]
    last: bool
    columns: StoredColumns
    def __init__(self, server_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., epoch: _Optional[int] = ..., objects: _Optional[_Iterable[_Union[StoredObject, _Mapping]]] = ..., last: _Optional[bool] = ..., columns: _Optional[_Union[StoredColumns, _Mapping]] = ...) -> None: ...

class ReportObjectsReply(_message.Message):
    __slots__ = ("adopted", "dropped", "parked")
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    PARKED_FIELD_NUMBER: _ClassVar[int]
    adopted: int
    dropped: int
    parked: int
    def __init__(self, adopted: _Optional[int] = ..., dropped: _Optional[int] = ..., parked: _Optional[int] = ...) -> None: ...

class DemoteCommand(_message.Message):
    __slots__ = ("object",)
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    object: StoredObject
    def __init__(self, object: _Optional[_Union[StoredObject, _Mapping]] = ...) -> None: ...

class PromoteCommand(_message.Message):
    __slots__ = ("object", "dram_offset")
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    DRAM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    object: StoredObject
    dram_offset: int
    def __init__(self, object: _Optional[_Union[StoredObject, _Mapping]] = ..., dram_offset: _Optional[int] = ...) -> None: ...

class Promoted(_message.Message):
    __slots__ = ("nvme_offset", "length", "dram_offset", "ok", "error")
    NVME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    nvme_offset: int
    length: int
    dram_offset: int
    ok: bool
    error: str
    def __init__(self, nvme_offset: _Optional[int] = ..., length: _Optional[int] = ..., dram_offset: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class Demoted(_message.Message):
    __slots__ = ("dram_offset", "length", "nvme_offset", "ok", "error")
    DRAM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NVME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    dram_offset: int
    length: int
    nvme_offset: int
    ok: bool
    error: str
    def __init__(self, dram_offset: _Optional[int] = ..., length: _Optional[int] = ..., nvme_offset: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class RegisterServerRequest(_message.Message):
    __slots__ = ("server_id", "host", "port", "hostname", "shm_path", "capacity", "secret", "incarnation", "nvme_capacity", "dram_read_gbps", "nvme_read_gbps", "nvme_write_gbps", "objects")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NVME_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DRAM_READ_GBPS_FIELD_NUMBER: _ClassVar[int]
    NVME_READ_GBPS_FIELD_NUMBER: _ClassVar[int]
    NVME_WRITE_GBPS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    host: str
    port: int
    hostname: str
    shm_path: str
    capacity: int
    secret: bytes
    incarnation: int
    nvme_capacity: int
    dram_read_gbps: float
    nvme_read_gbps: float
    nvme_write_gbps: float
    objects: int
    def __init__(self, server_id: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., hostname: _Optional[str] = ..., shm_path: _Optional[str] = ..., capacity: _Optional[int] = ..., secret: _Optional[bytes] = ..., incarnation: _Optional[int] = ..., nvme_capacity: _Optional[int] = ..., dram_read_gbps: _Optional[float] = ..., nvme_read_gbps: _Optional[float] = ..., nvme_write_gbps: _Optional[float] = ..., objects: _Optional[int] = ...) -> None: ...

class RegisterServerReply(_message.Message):
    __slots__ = ("heartbeat_interval_s", "heartbeat_timeout_s", "epoch", "report_columns")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPORT_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    epoch: int
    report_columns: bool
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., epoch: _Optional[int] = ..., report_columns: _Optional[bool] = ...) -> None: ...

class ServerCounters(_message.Message):
    __slots__ = ("reads", "writes", "read_bytes", "write_bytes", "errors", "connections", "freed_bytes", "connections_accepted", "connections_refused", "connections_idle_closed", "connections_send_timeouts", "protocol_errors", "bad_frames_suppressed")
    READS_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_IDLE_CLOSED_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_SEND_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    BAD_FRAMES_SUPPRESSED_FIELD_NUMBER: _ClassVar[int]
    reads: int
    writes: int
    read_bytes: int
    write_bytes: int
    errors: int
    connections: int
    freed_bytes: int
    connections_accepted: int
    connections_refused: int
    connections_idle_closed: int
    connections_send_timeouts: int
    protocol_errors: int
    bad_frames_suppressed: int
    def __init__(self, reads: _Optional[int] = ..., writes: _Optional[int] = ..., read_bytes: _Optional[int] = ..., write_bytes: _Optional[int] = ..., errors: _Optional[int] = ..., connections: _Optional[int] = ..., freed_bytes: _Optional[int] = ..., connections_accepted: _Optional[int] = ..., connections_refused: _Optional[int] = ..., connections_idle_closed: _Optional[int] = ..., connections_send_timeouts: _Optional[int] = ..., protocol_errors: _Optional[int] = ..., bad_frames_suppressed: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("server_id", "incarnation", "counters", "demoted", "nvme_used", "epoch", "nvme_lost", "promoted")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_FIELD_NUMBER: _ClassVar[int]
    NVME_USED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NVME_LOST_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    incarnation: int
    counters: ServerCounters
    demoted: _containers.RepeatedCompositeFieldContainer[Demoted]
    nvme_used: int
    epoch: int
    nvme_lost: _containers.RepeatedCompositeFieldContainer[Range]
    promoted: _containers.RepeatedCompositeFieldContainer[Promoted]
    def __init__(self, server_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., counters: _Optional[_Union[ServerCounters, _Mapping]] = ..., demoted: _Optional[_Iterable[_Union[Demoted, _Mapping]]] = ..., nvme_used: _Optional[int] = ..., epoch: _Optional[int] = ..., nvme_lost: _Optional[_Iterable[_Union[Range, _Mapping]]] = ..., promoted: _Optional[_Iterable[_Union[Promoted, _Mapping]]] = ...) -> None: ...

class Range(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("reregister", "free", "adopt", "demote", "drop_nvme", "promote", "more", "epoch", "next_beat_s")
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    ADOPT_FIELD_NUMBER: _ClassVar[int]
    DEMOTE_FIELD_NUMBER: _ClassVar[int]
    DROP_NVME_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_BEAT_S_FIELD_NUMBER: _ClassVar[int]
    reregister: bool
    free: _containers.RepeatedCompositeFieldContainer[Range]
    adopt: _containers.RepeatedCompositeFieldContainer[StoredObject]
    demote: _containers.RepeatedCompositeFieldContainer[DemoteCommand]
    drop_nvme: _containers.RepeatedCompositeFieldContainer[Range]
    promote: _containers.RepeatedCompositeFieldContainer[PromoteCommand]
    more: bool
    epoch: int
    next_beat_s: float
    def __init__(self, reregister: _Optional[bool] = ..., free: _Optional[_Iterable[_Union[Range, _Mapping]]] = ..., adopt: _Optional[_Iterable[_Union[StoredObject, _Mapping]]] = ..., demote: _Optional[_Iterable[_Union[DemoteCommand, _Mapping]]] = ..., drop_nvme: _Optional[_Iterable[_Union[Range, _Mapping]]] = ..., promote: _Optional[_Iterable[_Union[PromoteCommand, _Mapping]]] = ..., more: _Optional[bool] = ..., epoch: _Optional[int] = ..., next_beat_s: _Optional[float] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("model", "revision", "layout_json", "tp_size", "tp_rank", "cache_salt", "kv_dtype", "kv_identity")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    layout_json: str
    tp_size: int
    tp_rank: int
    cache_salt: str
    kv_dtype: str
    kv_identity: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., layout_json: _Optional[str] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., cache_salt: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., kv_identity: _Optional[str] = ...) -> None: ...

class RegisterNamespaceReply(_message.Message):
    __slots__ = ("fingerprint", "namespace_id")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    namespace_id: int
    def __init__(self, fingerprint: _Optional[bytes] = ..., namespace_id: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("server_id", "address", "alive", "capacity", "used", "objects", "counters", "heartbeat_age_s", "shm_path", "nvme_capacity", "nvme_used", "nvme_objects", "demotions", "demotions_in_flight", "dropped_not_demoted")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    NVME_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NVME_USED_FIELD_NUMBER: _ClassVar[int]
    NVME_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_NOT_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    alive: bool
    capacity: int
    used: int
    objects: int
    counters: ServerCounters
    heartbeat_age_s: float
    shm_path: str
    nvme_capacity: int
    nvme_used: int
    nvme_objects: int
    demotions: int
    demotions_in_flight: int
    dropped_not_demoted: int
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., alive: _Optional[bool] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., objects: _Optional[int] = ..., counters: _Optional[_Union[ServerCounters, _Mapping]] = ..., heartbeat_age_s: _Optional[float] = ..., shm_path: _Optional[str] = ..., nvme_capacity: _Optional[int] = ..., nvme_used: _Optional[int] = ..., nvme_objects: _Optional[int] = ..., demotions: _Optional[int] = ..., demotions_in_flight: _Optional[int] = ..., dropped_not_demoted: _Optional[int] = ...) -> None: ...

class GetStatsReply(_message.Message):
    __slots__ = ("servers", "counters", "namespaces", "role", "leader", "epoch")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[ServerStats]
    counters: _containers.ScalarMap[str, float]
    namespaces: int
    role: str
    leader: str
    epoch: int
    def __init__(self, servers: _Optional[_Iterable[_Union[ServerStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, float]] = ..., namespaces: _Optional[int] = ..., role: _Optional[str] = ..., leader: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("namespace", "keys", "groups")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    groups: int
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., groups: _Optional[int] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("evicted", "refused")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    refused: int
    def __init__(self, evicted: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...

class WatchRemovalsRequest(_message.Message):
    __slots__ = ("namespace", "max_batch", "keepalive_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_S_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    max_batch: int
    keepalive_s: float
    def __init__(self, namespace: _Optional[bytes] = ..., max_batch: _Optional[int] = ..., keepalive_s: _Optional[float] = ...) -> None: ...

class Removed(_message.Message):
    __slots__ = ("key", "group")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    group: int
    def __init__(self, key: _Optional[bytes] = ..., group: _Optional[int] = ...) -> None: ...

class RemovalBatch(_message.Message):
    __slots__ = ("removed", "gap", "cursor")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    removed: _containers.RepeatedCompositeFieldContainer[Removed]
    gap: bool
    cursor: int
    def __init__(self, removed: _Optional[_Iterable[_Union[Removed, _Mapping]]] = ..., gap: _Optional[bool] = ..., cursor: _Optional[int] = ...) -> None: ...
