// FitCache wire protocol between clients and cache servers.
//
// Regenerate the Go code with rpc/generate.sh after editing this file; the generated code in
// rpc/kitex_gen is committed.
namespace go fitcachepb

// Why a request failed, beside its errno: the causes that share an errno with others (see the
// sentinel errors of package core), so that a client tells them apart without reading the
// message. Every reply with an errno carries one (UNSPECIFIED on success and for other causes).
enum Reason {
  UNSPECIFIED = 0,
  OUTSIDE_ROOT = 1, // EACCES: the path or root is outside the dataset roots
  BAD_PATH = 2,     // EINVAL: a path not absolute or not clean
  TOO_LARGE = 3,    // EFBIG: not cached and too large to send; the caller reads the source
  CACHE_FULL = 4,   // ENOSPC: no room left for the dataset; the caller reads the source
  CHANGED = 5,      // EAGAIN: the source changed while being read
  CLOSED = 6,       // EBADF: the server is closing
  BAD_COPY = 7,     // EBADMSG: bytes sent for a replica copy do not match their owner's stamp
}

// Where the bytes of a reply came from: core.Origin, value for value (rpc tests hold the two
// together; the node socket's FC_ORIGIN_ values in capi/fcnode.h are the same numbers).
enum Origin {
  NONE = 0,                // no bytes (a failed request), or a server that did not say
  INFLIGHT = 1,            // a file another request on the server was reading or publishing
  SOURCE = 2,              // the source file, read by this request
  PEER = 3,                // bytes another node's server sent
  SOURCE_WHILE_CACHED = 4, // the source of a large file, handed over while it is cached whole
  MEMORY = 8,              // a tier of each kind (tiers.Kind), fastest first
  PMEM = 9,
  NVME = 10,
  DISK = 11,
}

// A tier directory of a server, so that a client on the same node can map cached files itself.
struct TierInfo {
  1: string dir
  2: string kind
}

// Field 1 of every request struct was the job token until connections were authenticated
// instead (see rpc/handshake.go): it is not to be reused.
struct HelloRequest {
  // The caller's job (a training run): its clients share one validation session, in which
  // each cached copy is checked against its source once (see core.Engine.BeginSession).
  // Empty: the server's current session, beginning none.
  2: string job
  // Set by a server that passes on to the job's other servers a job that began with one of
  // its node's readers (so that every server checks its copies for the job): the receiver
  // passes it on to nobody.
  3: bool relayed
}

struct HelloReply {
  1: i32 errno
  2: string message
  3: string server_id
  4: i32 pid
  5: list<TierInfo> tiers
  // 6 was generation_file, a removal counter no client read: not to be reused.
  // The server's node socket (package nodesock), where C code on the node without Go (the
  // preload shim of the transparent mode) opens files through it. May be empty.
  7: string node_socket
  // Why it failed, when errno alone does not say (see Reason).
  8: Reason reason
  // The caller's validation session: a cached copy whose index slot records an earlier
  // check is not served from the tiers without asking the server (see tiers.Dir.WithSession).
  9: i64 session
  // The size of the blocks ranges of large files are cached in (ReadRequest.block): a
  // client finds a cached block in the tiers by its name (tiers.BlockName). 0 from a server
  // older than blocks.
  10: i64 block_bytes
  // Membership gossip, as in ReadReply: this server's membership version and the servers it
  // holds dead (its clients' reports, the servers' membership, and listed servers that never
  // joined it), so that a new client waits for none of them at start.
  11: i64 membership_version
  12: list<string> dead
  // The servers alive in this server's membership (package membership; empty without one): a
  // listed server whose connections are refused although the membership holds it alive died
  // moments ago, rather than still starting with the job.
  13: list<string> alive
  // Readers on this server's node may read a small file they miss from the source themselves,
  // write its copy into the first tier and report it on the node socket (see tiers.Claim and
  // nodesock.OpRecord). False from a server older than that, and from cluster servers.
  14: bool reader_fills
  // The ring this server's cluster places files' owners on (ring.Fingerprint: its virtual
  // nodes and the job's servers), so that a client on another ring (another virtual_nodes,
  // another list of servers) is told rather than caching files twice. Empty from a server
  // that does not know the job's list, and from a server older than that.
  15: string ring
}

struct ReadRequest {
  // Dataset root the path must stay within (absolute, cleaned).
  2: string root
  // File to read (absolute, cleaned, inside root).
  3: string path
  // The caller runs on this server's node and maps tier files itself: when the file is cached
  // (or was just cached) the reply names the tier file instead of carrying the bytes.
  4: bool local
  // Membership gossip: the newest membership version the caller has seen from this server,
  // and the servers the caller found dead or alive again since it last told this server.
  5: i64 membership_version
  6: list<string> dead
  7: list<string> alive
  // When set, block number `block` of the file is read instead of the whole file: its bytes
  // from block * HelloReply.block_bytes on, block_bytes of them or fewer at the end of the
  // file, none past it (see core.Engine.ReadBlock). A reply for a block carries no stamp.
  8: optional i64 block
  // With block: only range_length bytes of the block from range_offset are sent (the block
  // is cached whole), fewer at its end; 0 caches the block and sends nothing. A reader of
  // ranges in cluster mode reads a range of a block another node holds this way. The reply's
  // mtime_nanos, ctime_nanos and inode are those of the source version the block copies.
  9: optional i64 range_offset
  10: optional i64 range_length
  // With block: the block size the caller numbers blocks in (HelloReply.block_bytes of the
  // server it learned it from). A server of another block size refuses the request (EINVAL)
  // rather than serve another block under that number.
  11: optional i64 block_bytes
}

struct ReadReply {
  // 0, or a Linux errno value (ENOENT, EACCES, EISDIR, ...) describing why the read failed.
  1: i32 errno
  2: string message
  3: i64 size
  // Set for local callers when the file is in a tier: the cached file to map.
  4: string cached_path
  // The file's bytes, when cached_path is empty and errno is 0.
  5: binary data
  // Where the server found the file, by name (a tier kind, "inflight", "source" or "peer"):
  // what servers older than origin (15) say. Servers write both, for clients older than 15;
  // a client reads it when origin is NONE. To be dropped once no server older than 15 runs.
  6: string origin_name
  // The source file's modification time (Unix nanoseconds), when known.
  7: i64 mtime_nanos
  // Membership gossip: this server's membership version and, when the caller's is older,
  // the servers its clients reported dead (so that other clients need not time out on them).
  8: i64 membership_version
  9: list<string> dead
  // Why it failed, when errno alone does not say (see Reason).
  10: Reason reason
  // What the file's owner vouches for, so that a replica can check a copy it is sent (see
  // StoreRequest): the CRC-32C of the data (as the tiers record it), the source's change time
  // and inode number (as the owner's source read saw them, or its tier recorded them; 0 where
  // unknown), and the
  // owner's stamp over path, size, mtime_nanos, ctime_nanos, inode and checksum (an HMAC
  // with the job's stamp key, rpc/stamp.go). Set on success, also for a cached_path reply.
  11: i64 checksum
  12: i64 ctime_nanos
  13: i64 inode
  14: binary stamp
  // Where the server found the file.
  15: Origin origin
}

// Several files of one dataset root, for a caller that cannot map tier files (another node's
// server, reading a DataLoader batch): one round trip, and the bytes of all of them together.
struct ReadBatchRequest {
  // Dataset root the paths must stay within (absolute, cleaned).
  1: string root
  // Files to read (absolute, cleaned, inside root).
  2: list<string> paths
  // Membership gossip, as in ReadRequest.
  3: i64 membership_version
  4: list<string> dead
  5: list<string> alive
}

struct ReadBatchReply {
  // Set when the request as a whole failed; each file has its own errno in replies.
  1: i32 errno
  2: string message
  3: Reason reason
  // One reply per path, in the order of the request: a file's errno, size, origin, times,
  // checksum and stamp as Read gives them, and no data (see data). A file that did not fit in
  // the room the reply had left has errno ENOBUFS: read it alone.
  4: list<ReadReply> replies
  // Membership gossip, as in ReadReply.
  5: i64 membership_version
  6: list<string> dead
  // The bytes of the files read (errno 0), one after the other in the order of replies, each
  // as long as its reply's size. Servers write it last, after every other field, so that a
  // client can read the bytes into its buffer once it has checked the rest.
  7: optional binary data
}

// Hits that clients served from tier files themselves, reported so that server counters see
// every read.
struct HitReport {
  2: map<string, i64> hits_by_tier
  3: i64 bytes
}

struct HitReportReply {
  1: i32 errno
  2: string message
  // Why it failed, when errno alone does not say (see Reason).
  3: Reason reason
}

// A file's bytes that a client read from the file's owner, sent to a replica so that the
// replica caches it without reading the source. The replica checks the bytes against the
// owner's checksum and stamp (fields 6 to 9, as the owner's ReadReply gave them) and the
// size and times against its own stat of the source before it keeps a copy.
struct StoreRequest {
  2: string root
  3: string path
  4: binary data
  5: i64 mtime_nanos
  6: i64 checksum
  7: i64 ctime_nanos
  8: i64 inode
  9: binary stamp
}

struct StoreReply {
  1: i32 errno
  2: string message
  // Why it failed, when errno alone does not say (see Reason).
  3: Reason reason
}

struct StatsRequest {
}

struct StatsReply {
  1: i32 errno
  2: string message
  // Counters and tier usage as a JSON object (see core.Stats).
  3: string json
  // Why it failed, when errno alone does not say (see Reason).
  4: Reason reason
}

// A prefetch job: a list of files the caller's readers are about to read, in their order,
// for the server to read from the source ahead of them (see core.Engine.Prefetch). A long list
// is sent in chunks, in order. A request without paths, offset 0 and total 0 renews the
// caller's job (its lease) and reports its progress.
struct PrefetchRequest {
  // Dataset root the paths must stay within (absolute, cleaned).
  2: string root
  // Identifies the caller (one client); a job lives while one of its owners renews it.
  3: string owner
  // Identifies the whole list (core.ListDigest): owners that send the same list share a job.
  4: string list_id
  // Position of paths[0] in the whole list, and the whole list's length.
  5: i64 offset
  6: i64 total
  // Files to read (absolute, cleaned, inside root).
  7: list<string> paths
  // The caller's validation session (HelloReply.session): a list joins only a job of this
  // session or a later one, which checks the cached copies ahead of the readers.
  8: i64 session
  // The list is of the readers of the server's node (cluster mode): the server brings each
  // file into a tier of its node, whichever server owns it (see core.PrefetchRequest.ForNode).
  9: bool for_node
  // With for_node: the first this_epoch paths of the whole list are what the node's readers
  // read now; the others only in later epochs (other ranks' parts), pulled after them a few
  // at a time (see core.PrefetchRequest.ThisEpoch). 0: all of them are read now.
  10: i64 this_epoch
}

struct PrefetchReply {
  1: i32 errno
  2: string message
  // The job's state: running, done, budget (stopped: the tiers are full), abandoned,
  // replaced, off (the server does not prefetch) or unknown (no job of this owner).
  3: string state
  // The server holds this list already (another owner's job, now shared): send no more of it.
  4: bool joined
  // Paths of this request taken.
  5: i64 accepted
  // Progress: the list's length, paths received, files dealt with, and how.
  6: i64 files
  7: i64 received
  8: i64 done
  9: i64 fetched
  10: i64 skipped_cached
  11: i64 skipped_inflight
  12: i64 failed
  13: i64 bytes
  14: i64 owners
  // The first failures, "path: error".
  15: list<string> errors
  // Why it failed, when errno alone does not say (see Reason).
  16: Reason reason
}

// What one tier holds of one dataset root: files and the room they take in the tier (data and
// records in 4 KiB blocks, as the tier's budget counts them).
struct CacheUsage {
  1: string root
  2: string tier
  3: string dir
  4: i64 files
  5: i64 bytes
}

struct UsageRequest {
}

struct UsageReply {
  1: i32 errno
  2: string message
  // Per tier (fastest first), then dataset root.
  3: list<CacheUsage> usage
  // Why it failed, when errno alone does not say (see Reason).
  4: Reason reason
}

// Removes the cached files of the dataset roots at or under root, or with all of every root,
// from every tier (see core.Engine.Clear).
struct ClearRequest {
  // Absolute and clean; ignored with all.
  2: string root
  3: bool all
  // Remove nothing: report what would be removed.
  4: bool dry_run
}

struct ClearReply {
  1: i32 errno
  2: string message
  // What was (with dry_run: would be) removed, per tier and dataset root.
  3: list<CacheUsage> cleared
  // Why it failed, when errno alone does not say (see Reason).
  4: Reason reason
}

// Forget drops the cached copies of one file from the server's tiers: its source is being
// written, renamed over, removed or truncated (through the preload shim, see
// core.Engine.Forget).
struct ForgetRequest {
  // Absolute and clean; path inside root.
  2: string root
  3: string path
}

struct ForgetReply {
  1: i32 errno
  2: string message
  // Why it failed, when errno alone does not say (see Reason).
  3: Reason reason
}

service FitCache {
  HelloReply Hello(1: HelloRequest req)
  ReadReply Read(1: ReadRequest req)
  ReadBatchReply ReadBatch(1: ReadBatchRequest req)
  HitReportReply ReportHits(1: HitReport req)
  StatsReply Stats(1: StatsRequest req)
  StoreReply Store(1: StoreRequest req)
  PrefetchReply Prefetch(1: PrefetchRequest req)
  UsageReply Usage(1: UsageRequest req)
  ClearReply Clear(1: ClearRequest req)
  ForgetReply Forget(1: ForgetRequest req)
}
