"""The log's store: the only code that speaks to the `events` and `log_head` tables.

One module per concern: `appending` (the head lock, numbering, chaining, the
write), `position` (the head), `records` (how an event row is selected and
what a read makes of it), `filters` (the feed filters as SQL), `reads` (the
global feed, pages for the projections, one stream, a seq's time) and `audit`
(the hash chain and the signed checkpoints as stored). Everything above the log
asks these modules; none of it names the tables.

The names below are the store's interface: `from taskledger import log as store`.
"""

from taskledger.log.appending import ANY, NOTIFY_CHANNEL, LogTx, Write, append
from taskledger.log.filters import feed_where, type_filter_sql
from taskledger.log.position import HEAD_SEQ_SQL, Head, head, lock_head
from taskledger.log.reads import (
    event_json_at,
    event_json_pages,
    feed_rows,
    read,
    read_json,
    read_page,
    read_stream,
    read_stream_before,
    read_stream_firsts,
    recorded_at,
    seq_at,
    stream_events,
    stream_position,
    stream_rows,
    stream_version,
    tail_rows,
)
from taskledger.log.records import (
    EVENT_COLUMNS_SQL,
    EVENT_ROW_SQL,
    LogEvent,
    NewEvent,
    RecordedEvent,
    event_json,
    record_from_row,
)

__all__ = [
    "ANY",
    "EVENT_COLUMNS_SQL",
    "EVENT_ROW_SQL",
    "HEAD_SEQ_SQL",
    "NOTIFY_CHANNEL",
    "Head",
    "LogEvent",
    "LogTx",
    "NewEvent",
    "RecordedEvent",
    "Write",
    "append",
    "event_json",
    "event_json_at",
    "event_json_pages",
    "feed_rows",
    "feed_where",
    "head",
    "lock_head",
    "read",
    "read_json",
    "read_page",
    "read_stream",
    "read_stream_before",
    "read_stream_firsts",
    "record_from_row",
    "recorded_at",
    "seq_at",
    "stream_events",
    "stream_position",
    "stream_rows",
    "stream_version",
    "tail_rows",
    "type_filter_sql",
]
