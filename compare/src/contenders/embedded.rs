//! The embedded contenders: idemdb itself, and what a user would otherwise write on RocksDB
//! (no dedup at all, a get-then-write under a lock, a pessimistic transaction).
//!
//! Every RocksDB contender writes the same bytes per new message: a 22-byte marker key with a
//! 31-byte marker value (the size of an idemdb record without a result, kept the default
//! retention; 46 bytes before record format 2) and the 16-byte business
//! key with its 64-byte value, in one write batch. The RocksDB options are idemdb's own, so only
//! the dedup logic differs.

use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use idemdb::{BatchOutcome, Durability, Engine, Fingerprint, Message, Outcome, TableOptions};
use rocksdb::{
    BlockBasedOptions, ColumnFamilyDescriptor, DB, DBCompressionType, TransactionDB,
    TransactionDBOptions, TransactionOptions, WriteBatch, WriteOptions,
};

use crate::workloads::{Delivery, Session};

/// Bytes of an idemdb record with an empty result, kept the default retention: the marker value
/// the raw contenders write.
const MARKER_VALUE: [u8; 31] = [1; 31];

pub struct Idemdb {
    engine: Engine,
}

impl Idemdb {
    pub fn open(dir: &Path, durability: Durability) -> Result<Idemdb> {
        let engine = Engine::builder(dir)
            .durability(durability)
            .business_table(TableOptions::new("orders"))
            .open()?;
        Ok(Idemdb { engine })
    }

    /// On RocksDB's WAL (`EngineBuilder::without_commit_log`) instead of the default commit log.
    pub fn open_wal(dir: &Path, durability: Durability) -> Result<Idemdb> {
        let engine = Engine::builder(dir)
            .durability(durability)
            .without_commit_log()
            .business_table(TableOptions::new("orders"))
            .open()?;
        Ok(Idemdb { engine })
    }

    /// `Durability::Sync` with the commit log of the shape measured before it was the default
    /// (4 segments of 64 MiB, made whole at the first open).
    pub fn open_with_commit_log(dir: &Path) -> Result<Idemdb> {
        let engine = Engine::builder(dir)
            .durability(Durability::Sync)
            .commit_log(4, 64 << 20)
            .business_table(TableOptions::new("orders"))
            .open()?;
        Ok(Idemdb { engine })
    }

    /// Flushes the memtables: a warm-up step.
    pub fn flush(&self) -> Result<()> {
        Ok(self.engine.flush()?)
    }

    pub fn session(&self) -> Result<Box<dyn Session>> {
        Ok(Box::new(self.batch_session()?))
    }

    fn batch_session(&self) -> Result<IdemdbSession> {
        Ok(IdemdbSession {
            consumer: self.engine.consumer(crate::workloads::CONSUMER)?,
            orders: self.engine.business_table("orders")?,
        })
    }

    /// A session that keeps up to `depth` durable batches in flight through the library's
    /// pipeline ([`LibraryPipelineSession`]).
    pub fn library_pipeline_session(&self, depth: usize) -> Result<Box<dyn Session>> {
        let session = self.batch_session()?;
        let pipeline = session.consumer.pipeline(depth)?;
        Ok(Box::new(LibraryPipelineSession {
            session,
            pipeline,
            calls: 0,
            held: Vec::new(),
        }))
    }

    /// A session that keeps up to `depth` durable batches in flight ([`PipelinedSession`]).
    pub fn pipelined_session(&self, depth: usize) -> Result<Box<dyn Session>> {
        Ok(Box::new(PipelinedSession {
            session: self.batch_session()?,
            runtime: tokio::runtime::Builder::new_current_thread().build()?,
            in_flight: std::collections::VecDeque::new(),
            depth: depth.max(1),
            calls: 0,
            held: Vec::new(),
        }))
    }
}

struct IdemdbSession {
    consumer: idemdb::Consumer,
    orders: idemdb::BusinessTable,
}

impl Session for IdemdbSession {
    fn deliver(&mut self, deliveries: &[Delivery]) -> Result<()> {
        if let [delivery] = deliveries {
            let value = delivery.value();
            match self.consumer.begin(delivery.key, Fingerprint::of(value))? {
                Outcome::Fresh(mut claim) => {
                    claim.put(&self.orders, delivery.key, value)?;
                    claim.commit(b"")?;
                }
                Outcome::Duplicate { .. } => {}
                other => bail!("unexpected outcome {other:?}"),
            }
            return Ok(());
        }
        let (batch, held) = self.claim_batch(deliveries)?;
        if !held.is_empty() {
            bail!("{} messages held by another claim", held.len());
        }
        batch.commit(|_| b"")?;
        Ok(())
    }
}

impl IdemdbSession {
    /// Claims a batch of deliveries and stages each fresh one's business value. Returns the
    /// batch and the indexes of the deliveries whose key another claim held (`InProgress`).
    fn claim_batch(&self, deliveries: &[Delivery]) -> Result<(idemdb::ClaimBatch, Vec<usize>)> {
        let values: Vec<_> = deliveries.iter().map(Delivery::value).collect();
        let messages: Vec<Message<'_>> = deliveries
            .iter()
            .zip(&values)
            .map(|(delivery, value)| Message::new(&delivery.key, Fingerprint::of(value)))
            .collect();
        let mut batch = self.consumer.begin_batch(&messages)?;
        let mut held = Vec::new();
        for (index, delivery) in deliveries.iter().enumerate() {
            match &batch.outcomes()[index] {
                BatchOutcome::Fresh => {
                    let claim = batch.claim_mut(index).context("fresh claim")?;
                    claim.put(&self.orders, delivery.key, values[index])?;
                }
                BatchOutcome::DuplicateInBatch { .. }
                | BatchOutcome::Settled(Outcome::Duplicate { .. }) => {}
                BatchOutcome::Settled(Outcome::InProgress { .. }) => held.push(index),
                other => bail!("unexpected batch outcome {other:?}"),
            }
        }
        Ok((batch, held))
    }

    /// Delivers again the held deliveries that waited for batches up to `through` (now
    /// durable): each must be a duplicate.
    fn redeliver_held(&self, held: &mut Vec<(u64, Delivery)>, through: u64) -> Result<()> {
        let (ready, waiting): (Vec<_>, Vec<_>) =
            held.drain(..).partition(|(after, _)| *after <= through);
        *held = waiting;
        for (_, delivery) in ready {
            let fingerprint = Fingerprint::of(delivery.value());
            match self.consumer.begin(delivery.key, fingerprint)? {
                Outcome::Duplicate { .. } => {}
                other => bail!("a redelivered message got {other:?}, not a duplicate"),
            }
        }
        Ok(())
    }
}

/// idemdb's durable batches with up to `depth` in flight: each call claims its batch and hands
/// it to the engine's committer (`ClaimBatch::commit_async`), then, with `depth` batches in
/// flight, waits until the oldest is durable. Batches are claimed and staged while earlier ones
/// are synced, and batches waiting together are written as one group; each batch is
/// acknowledged `depth - 1` calls later. A re-sent message whose first copy is in a batch still
/// in flight finds its key held (`InProgress`), as a consumer's would; it is delivered again,
/// and is then a duplicate, once every batch that was in flight before it is durable (a
/// consumer would requeue it; the pipeline does not stop for it).
struct PipelinedSession {
    session: IdemdbSession,
    runtime: tokio::runtime::Runtime,
    /// The batches in flight, oldest first, each with its call's number.
    in_flight: std::collections::VecDeque<(u64, idemdb::BatchCommitFuture)>,
    depth: usize,
    calls: u64,
    /// Held deliveries, each with the number of the newest batch that was in flight before it.
    held: Vec<(u64, Delivery)>,
}

impl PipelinedSession {
    /// Waits for the oldest batch in flight, then delivers again what waited for it.
    fn complete_oldest(&mut self) -> Result<()> {
        let Some((call, oldest)) = self.in_flight.pop_front() else {
            return Ok(());
        };
        self.runtime.block_on(oldest)?;
        self.session.redeliver_held(&mut self.held, call)
    }
}

impl Session for PipelinedSession {
    fn deliver(&mut self, deliveries: &[Delivery]) -> Result<()> {
        let (batch, held) = self.session.claim_batch(deliveries)?;
        let call = self.calls;
        self.calls += 1;
        if let Some((newest, _)) = self.in_flight.back() {
            self.held
                .extend(held.into_iter().map(|index| (*newest, deliveries[index])));
        } else if !held.is_empty() {
            bail!("a message held with no batch in flight");
        }
        self.in_flight
            .push_back((call, batch.commit_async(|_| b"")));
        while self.in_flight.len() >= self.depth {
            self.complete_oldest()?;
        }
        Ok(())
    }
}

impl Drop for PipelinedSession {
    fn drop(&mut self) {
        while !self.in_flight.is_empty() {
            // The run is over; a failure of a last batch was already counted by nobody, so
            // say it rather than lose it.
            if let Err(error) = self.complete_oldest() {
                eprintln!("idemdb pipelined: a last batch failed: {error}");
            }
        }
    }
}

/// idemdb's durable batches through the library's pipeline (`Consumer::pipeline`): each call
/// claims its batch and hands it over; the pipeline waits for the oldest only with `depth` in
/// flight. What a consumer gets without writing its own pipeline. Held messages (a re-send
/// whose first copy is in a batch in flight) are delivered again once the batches before them
/// settle, as in [`PipelinedSession`].
struct LibraryPipelineSession {
    session: IdemdbSession,
    pipeline: idemdb::Pipeline<u64>,
    calls: u64,
    /// Held deliveries, each with the number of the newest batch handed over before it.
    held: Vec<(u64, Delivery)>,
}

impl LibraryPipelineSession {
    /// Takes the settled batches, then delivers again what waited for them.
    fn take(&mut self, settled: Vec<idemdb::Settled<u64>>) -> Result<()> {
        let Some(newest) = settled.last().map(|settled| settled.tag) else {
            return Ok(());
        };
        for settled in settled {
            settled.outcome?;
        }
        self.session.redeliver_held(&mut self.held, newest)
    }
}

impl Session for LibraryPipelineSession {
    fn deliver(&mut self, deliveries: &[Delivery]) -> Result<()> {
        let (batch, held) = self.session.claim_batch(deliveries)?;
        let call = self.calls;
        self.calls += 1;
        if !held.is_empty() {
            let before = call
                .checked_sub(1)
                .context("a message held with no batch before")?;
            self.held
                .extend(held.into_iter().map(|index| (before, deliveries[index])));
        }
        self.pipeline.commit_batch(batch, |_| b"", call);
        let settled = self.pipeline.settled();
        self.take(settled)
    }
}

impl Drop for LibraryPipelineSession {
    fn drop(&mut self) {
        let settled = self.pipeline.wait();
        if let Err(error) = self.take(settled) {
            eprintln!("idemdb library pipeline: a last batch failed: {error}");
        }
    }
}

/// How the raw RocksDB contenders decide whether a message is new.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawMode {
    /// No check at all: every delivery's bytes are written (the ceiling).
    BlindPut,
    /// `get` the marker, then write marker + business value, under one global lock.
    GetThenWrite,
    /// A hand-written batch dedup: one `multi_get` of the batch's markers, then one write
    /// batch of the new markers and their business values (a marker repeated inside the batch
    /// written once), under one global lock.
    MultiGetThenWrite,
    /// As [`RawMode::BlindPut`], made durable by a log of our own instead of RocksDB's WAL:
    /// the write batch's bytes written in place into a file filled once (a ring), then
    /// `fdatasync`, then the batch written to RocksDB without its WAL. The floor of the commit
    /// log design (docs/design.md, "The commit log") for the same bytes: no dedup, no recovery,
    /// no checksum, one writer at a time.
    BlindPutOwnLog,
}

/// RocksDB tuned as idemdb tunes it; see `rocksdb_options`.
pub struct Raw {
    db: Arc<DB>,
    mode: RawMode,
    write_options: Arc<WriteOptions>,
    /// Guards nothing but the check-then-write sequence ([`RawMode::GetThenWrite`],
    /// [`RawMode::MultiGetThenWrite`]).
    lock: Arc<Mutex<()>>,
    /// The ring of [`RawMode::BlindPutOwnLog`].
    log: Option<Arc<Mutex<InPlaceLog>>>,
}

/// A file filled once and written in place as a ring: [`RawMode::BlindPutOwnLog`]'s log.
struct InPlaceLog {
    file: std::fs::File,
    offset: u64,
}

impl InPlaceLog {
    fn create(dir: &Path) -> Result<InPlaceLog> {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(dir.join("own-log.bin"))?;
        let block = vec![0u8; 1 << 20];
        for _ in 0..FDATASYNC_FILE_BYTES / (1 << 20) {
            file.write_all(&block)?;
        }
        file.sync_all()?;
        Ok(InPlaceLog { file, offset: 0 })
    }

    /// Writes `bytes` at the next place (from the start again when they do not fit) and syncs.
    fn write_synced(&mut self, bytes: &[u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        if self.offset + bytes.len() as u64 > FDATASYNC_FILE_BYTES {
            self.offset = 0;
        }
        self.file.write_all_at(bytes, self.offset)?;
        self.file.sync_data()?;
        self.offset += bytes.len() as u64;
        Ok(())
    }
}

impl Raw {
    pub fn open(dir: &Path, durability: Durability, mode: RawMode) -> Result<Raw> {
        let db = DB::open_cf_descriptors(&db_options(), dir, column_families())?;
        let (write_options, log) = if mode == RawMode::BlindPutOwnLog {
            let mut options = WriteOptions::default();
            options.disable_wal(true);
            (
                options,
                Some(Arc::new(Mutex::new(InPlaceLog::create(dir)?))),
            )
        } else {
            (write_options(durability), None)
        };
        Ok(Raw {
            db: Arc::new(db),
            mode,
            write_options: Arc::new(write_options),
            lock: Arc::default(),
            log,
        })
    }

    /// Flushes the memtables: a warm-up step.
    pub fn flush(&self) -> Result<()> {
        for table in ["markers", "orders"] {
            self.db
                .flush_cf(&self.db.cf_handle(table).context("table")?)?;
        }
        Ok(())
    }

    pub fn session(&self) -> Box<dyn Session> {
        Box::new(RawSession {
            db: self.db.clone(),
            mode: self.mode,
            write_options: self.write_options.clone(),
            lock: self.lock.clone(),
            log: self.log.clone(),
        })
    }
}

struct RawSession {
    db: Arc<DB>,
    mode: RawMode,
    write_options: Arc<WriteOptions>,
    lock: Arc<Mutex<()>>,
    log: Option<Arc<Mutex<InPlaceLog>>>,
}

impl Session for RawSession {
    fn deliver(&mut self, deliveries: &[Delivery]) -> Result<()> {
        let markers = self.db.cf_handle("markers").context("markers table")?;
        let orders = self.db.cf_handle("orders").context("orders table")?;
        let mut batch = WriteBatch::default();
        let _guard = match self.mode {
            RawMode::BlindPut | RawMode::BlindPutOwnLog => None,
            RawMode::GetThenWrite | RawMode::MultiGetThenWrite => {
                Some(self.lock.lock().expect("lock"))
            }
        };
        if self.mode == RawMode::MultiGetThenWrite {
            let keys: Vec<_> = deliveries.iter().map(Delivery::peer_key).collect();
            let found = self.db.batched_multi_get_cf(&markers, &keys, false);
            let mut written = Vec::with_capacity(deliveries.len());
            for ((delivery, key), found) in deliveries.iter().zip(&keys).zip(found) {
                if found?.is_some() || written.contains(&key) {
                    continue;
                }
                written.push(key);
                batch.put_cf(&markers, key, MARKER_VALUE);
                batch.put_cf(&orders, delivery.key, delivery.value());
            }
            if !batch.is_empty() {
                self.db.write_opt(batch, &self.write_options)?;
            }
            return Ok(());
        }
        for delivery in deliveries {
            let marker = delivery.peer_key();
            if self.mode == RawMode::GetThenWrite
                && self.db.get_pinned_cf(&markers, marker)?.is_some()
            {
                continue;
            }
            batch.put_cf(&markers, marker, MARKER_VALUE);
            batch.put_cf(&orders, delivery.key, delivery.value());
        }
        if !batch.is_empty() {
            match &self.log {
                // Durable in the log first, then visible (RocksDB's order with its WAL).
                Some(log) => {
                    let mut log = log.lock().expect("log");
                    log.write_synced(batch.data())?;
                    self.db.write_opt(batch, &self.write_options)?;
                }
                None => self.db.write_opt(batch, &self.write_options)?,
            }
        }
        Ok(())
    }
}

/// RocksDB's pessimistic `TransactionDB`: `get_for_update` locks the marker key, then the
/// transaction writes marker + business value and commits.
pub struct Transactional {
    db: Arc<TransactionDB>,
    write_options: Arc<WriteOptions>,
}

impl Transactional {
    pub fn open(dir: &Path, durability: Durability) -> Result<Transactional> {
        let db = TransactionDB::open_cf_descriptors(
            &db_options(),
            &TransactionDBOptions::default(),
            dir,
            column_families(),
        )?;
        Ok(Transactional {
            db: Arc::new(db),
            write_options: Arc::new(write_options(durability)),
        })
    }

    pub fn session(&self) -> Box<dyn Session> {
        Box::new(TransactionalSession {
            db: self.db.clone(),
            write_options: self.write_options.clone(),
        })
    }
}

struct TransactionalSession {
    db: Arc<TransactionDB>,
    write_options: Arc<WriteOptions>,
}

impl Session for TransactionalSession {
    fn deliver(&mut self, deliveries: &[Delivery]) -> Result<()> {
        let markers = self.db.cf_handle("markers").context("markers table")?;
        let orders = self.db.cf_handle("orders").context("orders table")?;
        let transaction = self
            .db
            .transaction_opt(&self.write_options, &TransactionOptions::default());
        for delivery in deliveries {
            let marker = delivery.peer_key();
            if transaction
                .get_for_update_cf(&markers, marker, true)?
                .is_some()
            {
                continue;
            }
            transaction.put_cf(&markers, marker, MARKER_VALUE)?;
            transaction.put_cf(&orders, delivery.key, delivery.value())?;
        }
        transaction.commit()?;
        Ok(())
    }
}

fn write_options(durability: Durability) -> WriteOptions {
    let mut options = WriteOptions::default();
    options.set_sync(durability == Durability::Sync);
    options
}

/// The database options idemdb sets (see its `engine.rs`), so the raw contenders differ from it
/// only in the dedup logic.
pub fn db_options() -> rocksdb::Options {
    let mut options = base_db_options();
    options.set_allow_concurrent_memtable_write(false);
    options
}

/// idemdb's database options without its two write-path choices (left at RocksDB's defaults):
/// what `wal-options` starts from.
pub fn base_db_options() -> rocksdb::Options {
    let mut options = rocksdb::Options::default();
    options.create_if_missing(true);
    options.create_missing_column_families(true);
    options.set_paranoid_checks(true);
    options.set_wal_recovery_mode(rocksdb::DBRecoveryMode::PointInTime);
    options.set_max_background_jobs(2);
    options.set_max_open_files(-1);
    options
}

fn table_options() -> rocksdb::Options {
    let mut block = BlockBasedOptions::default();
    block.set_block_cache(&rocksdb::Cache::new_lru_cache(64 << 20));
    block.set_bloom_filter(10.0, false);
    block.set_whole_key_filtering(true);
    block.set_cache_index_and_filter_blocks(true);
    block.set_index_type(rocksdb::BlockBasedIndexType::TwoLevelIndexSearch);
    block.set_partition_filters(true);
    block.set_metadata_block_size(4096);
    block.set_pin_top_level_index_and_filter(true);
    block.set_cache_index_and_filter_blocks_with_high_priority(true);
    let mut options = rocksdb::Options::default();
    options.set_block_based_table_factory(&block);
    options.set_memtable_prefix_bloom_ratio(0.02);
    options.set_memtable_whole_key_filtering(true);
    options.set_compression_type(DBCompressionType::Zstd);
    options.set_compression_options(-14, 1, 0, 0);
    options.set_bottommost_compression_type(DBCompressionType::Zstd);
    options.set_bottommost_compression_options(-14, 3, 0, 0, true);
    options.set_write_buffer_size(64 << 20);
    options.set_level_compaction_dynamic_level_bytes(true);
    options
}

fn column_families() -> Vec<ColumnFamilyDescriptor> {
    ["markers", "orders"]
        .into_iter()
        .map(|name| ColumnFamilyDescriptor::new(name, table_options()))
        .collect()
}

/// The disk's durable-write latency: 4 KiB written in place into a preallocated file, then
/// `fdatasync`. A durable commit cannot be faster than one of these.
pub struct Fdatasync {
    file: std::fs::File,
    offset: u64,
    append: bool,
    /// In place through an `O_DIRECT | O_DSYNC` descriptor instead (durable when the write
    /// returns, no page cache), as the commit log writes on the durable path: the floor of that
    /// design, beside the page cache's.
    direct: Option<DirectBlock>,
}

/// A descriptor opened with `O_DIRECT | O_DSYNC` and one 4 KiB block of aligned memory.
struct DirectBlock {
    file: std::fs::File,
    memory: Vec<u8>,
    start: usize,
}

/// Size of the preallocated file; writes wrap around inside it.
const FDATASYNC_FILE_BYTES: u64 = 64 << 20;
const FDATASYNC_WRITE_BYTES: usize = 4096;
/// About one claim's WAL record (marker and a 64-byte business value).
const FDATASYNC_APPEND_BYTES: usize = 200;

impl Fdatasync {
    pub fn create(dir: &Path, append: bool, direct: bool) -> Result<Fdatasync> {
        if append {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(true)
                .write(true)
                .open(dir.join("fdatasync-append.bin"))?;
            preallocate_keeping_size(&file)?;
            file.sync_all()?;
            return Ok(Fdatasync {
                file,
                offset: 0,
                append,
                direct: None,
            });
        }
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(dir.join("fdatasync.bin"))?;
        // Written, not only allocated: an in-place write then needs no metadata update.
        let block = vec![0u8; 1 << 20];
        for _ in 0..FDATASYNC_FILE_BYTES / (1 << 20) {
            file.write_all(&block)?;
        }
        file.sync_all()?;
        let direct = if direct {
            use std::os::unix::fs::OpenOptionsExt;
            let direct_file = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT | libc::O_DSYNC)
                .open(dir.join("fdatasync.bin"))?;
            let memory = vec![0x5au8; 2 * FDATASYNC_WRITE_BYTES];
            let start = (FDATASYNC_WRITE_BYTES - memory.as_ptr().addr() % FDATASYNC_WRITE_BYTES)
                % FDATASYNC_WRITE_BYTES;
            Some(DirectBlock {
                file: direct_file,
                memory,
                start,
            })
        } else {
            None
        };
        Ok(Fdatasync {
            file,
            offset: 0,
            append,
            direct,
        })
    }

    /// Appends one record at the end and syncs it; a full file starts over empty, as a new WAL
    /// file would.
    fn append(&mut self) -> Result<()> {
        use std::os::unix::fs::FileExt;
        if self.offset + FDATASYNC_APPEND_BYTES as u64 > FDATASYNC_FILE_BYTES {
            self.file.set_len(0)?;
            preallocate_keeping_size(&self.file)?;
            self.offset = 0;
        }
        let record = [0x5au8; FDATASYNC_APPEND_BYTES];
        self.file.write_all_at(&record, self.offset)?;
        self.file.sync_data()?;
        self.offset += FDATASYNC_APPEND_BYTES as u64;
        Ok(())
    }
}

/// Allocates the file's blocks without changing its size (`FALLOC_FL_KEEP_SIZE`), as RocksDB
/// does for a new WAL file.
fn preallocate_keeping_size(file: &std::fs::File) -> Result<()> {
    use std::os::fd::AsRawFd;
    let length = libc::off_t::try_from(FDATASYNC_FILE_BYTES)?;
    // SAFETY: a plain system call on an open descriptor this function borrows.
    let status = unsafe { libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, length) };
    if status != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(())
}

impl Session for Fdatasync {
    fn deliver(&mut self, _deliveries: &[Delivery]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        if self.append {
            return self.append();
        }
        if let Some(direct) = &self.direct {
            let block = &direct.memory[direct.start..direct.start + FDATASYNC_WRITE_BYTES];
            direct.file.write_all_at(block, self.offset)?;
        } else {
            let block = [0x5au8; FDATASYNC_WRITE_BYTES];
            self.file.write_all_at(&block, self.offset)?;
            self.file.sync_data()?;
        }
        self.offset = (self.offset + FDATASYNC_WRITE_BYTES as u64) % FDATASYNC_FILE_BYTES;
        Ok(())
    }
}
