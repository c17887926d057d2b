//! # idemdb
//!
//! Exactly-once *effects* for at-least-once consumers: an embedded, in-process store on RocksDB
//! that remembers which messages a consumer has processed, and commits that marker in the same
//! write batch as the consumer's own writes.
//!
//! Brokers deliver at least once. A message reaches the consumer again when the producer retries
//! after a lost acknowledgement, when a consumer crashes or loses its lock before it acknowledges,
//! or when it commits its writes and crashes before the acknowledgement. For each delivery the
//! consumer calls [`Consumer::begin`] with the message's business key (an order id, or
//! [`cloudevents_key`]; never a delivery-attempt id) and a [`Fingerprint`] of its content, and
//! matches the [`Outcome`]:
//!
//! | outcome | meaning | the consumer |
//! |---|---|---|
//! | [`Outcome::Fresh`] | the key was free; the caller now holds it (a [`Claim`]) | processes, stages its writes on the claim, commits, acks |
//! | [`Outcome::Duplicate`] | processed before; carries the stored result | acks without effect |
//! | [`Outcome::InProgress`] | another claim holds the key right now | nacks: the broker redelivers later |
//! | [`Outcome::Conflict`] | the key was completed with different content | dead-letters and alerts |
//! | [`Outcome::TooLate`] | produced before the retention horizon (admission floor, opt-in) | dead-letters |
//! | [`Outcome::Stale`] | not newer than the entity's applied version (ordering guard, opt-in) | acks without effect |
//!
//! [`Claim::commit`] writes the marker record (with the result later duplicates get) and every
//! business write staged on the claim in **one RocksDB write batch**: both are durable or neither
//! is. Dropping a claim writes nothing and frees the key, so the broker's redelivery is processed
//! again.
//!
//! One [`Engine`] owns one RocksDB directory, in one process; its clones and handles share it.
//! Each consumer ([`Engine::consumer`]) is a key space of its own, so consumers sharing a store
//! never suppress each other; entity tables and business tables are column families. A
//! consumer's records expire exactly at read time once the retention has passed
//! ([`EngineBuilder::retention`]; entity records never expire by default), and a compaction
//! filter reclaims their space later. [`Durability::Sync`] (the default) makes a commit durable
//! before it returns, in idemdb's own commit log (rewritten in place; a new store writes 8 MiB
//! of it, and it grows with the write rate and shrinks back once the store is quiet:
//! [`EngineBuilder::commit_log`], [`EngineBuilder::commit_log_shrink_after`]), or in RocksDB's WAL
//! with [`EngineBuilder::without_commit_log`].
//!
//! # What it is not
//!
//! - **Not a broker.** It does not deliver, queue, order or retry messages. The broker
//!   redelivers; idemdb recognises the redelivery.
//! - **Not distributed, not replicated.** A store is one directory on one machine's disk.
//!   Consumers on several hosts each need their own store, and the broker must route every
//!   delivery of a key to the same one (partition by key); otherwise each host may process it.
//! - **Not a cross-process lock.** Claims are arbitrated by a latch in the engine's memory.
//!   A lock on the store directory gives the store to one `Engine` in one process; a second open,
//!   here or in another process and through any path to the directory, is
//!   [`Error::AlreadyOpen`]. The operator tools'
//!   [`admin::StoreBuilder::open_read_only`] is the exception: it reads beside the owner, without
//!   the lock, and never writes.
//! - **Not exactly-once delivery.** Messages still arrive more than once. What happens once is the
//!   effect of the writes *staged on the claim*, because they commit with the marker. A side
//!   effect outside the batch (an HTTP call, an e-mail, another database) happens again if the
//!   process dies after it and before the commit. For those, take the key with
//!   [`Consumer::begin_external`] and pass [`ExternalClaim::derive_key`] downstream as its
//!   idempotency key: the effect is then once only if the downstream service honours that key.
//! - **Not a general key-value store.** Business tables are written only through claims and read
//!   by key ([`BusinessTable::get`]): no writes outside a claim, no scans, no transaction spanning
//!   two claims.
//!
//! # Limits
//!
//! Every input is bounded by a named constant. A violation is [`Error::LimitExceeded`] naming the
//! [`Limit`], returned before anything is staged or written (builder options: when the engine
//! opens); never a panic.
//!
//! | what | bounds | constants |
//! |---|---|---|
//! | consumer id | 1..=255 bytes | [`CONSUMER_ID_BYTES_MIN`], [`CONSUMER_ID_BYTES_MAX`] |
//! | message key; entity key; the entity of [`Message::version`]; a [`cloudevents_key`] | 1..=1024 bytes | [`MESSAGE_KEY_BYTES_MIN`], [`MESSAGE_KEY_BYTES_MAX`] |
//! | result stored with a record | 0..=64 MiB | [`RESULT_BYTES_MAX`] |
//! | business writes staged on one claim | at most 65,536 | [`STAGED_WRITES_MAX`] |
//! | keys, values and result one claim commits | at most 256 MiB | [`STAGED_BYTES_MAX`] |
//! | key of a staged write | 1 byte..=64 KiB | [`TABLE_KEY_BYTES_MIN`], [`TABLE_KEY_BYTES_MAX`] |
//! | value or merge operand of a staged write | 0..=64 MiB | [`TABLE_VALUE_BYTES_MAX`] |
//! | messages per [`Consumer::begin_batch`] | at most 4096 | [`BATCH_MESSAGES_MAX`] |
//! | source (topic, stream) of a read position | 1..=255 bytes | [`POSITION_SOURCE_BYTES_MIN`], [`POSITION_SOURCE_BYTES_MAX`] |
//! | lease of an external claim (renew for longer) | 1 ms..=7 days | [`LEASE_MS_MIN`], [`LEASE_MS_MAX`] |
//! | retention, and a claim's own [`Expiry`] | 1 ms..=3650 days; default 7 days | [`RETENTION_MS_MIN`], [`RETENTION_MS_MAX`], [`RETENTION_MS_DEFAULT`] |
//! | external holder's identity | 0..=255 bytes | [`HOLDER_BYTES_MAX`] |
//! | table name | 1..=64 bytes of `[A-Za-z0-9_.-]`, not `default`, not starting with `idemdb` | [`TABLE_NAME_BYTES_MIN`], [`TABLE_NAME_BYTES_MAX`] |
//! | declared tables (business and entity) | at most 64 | [`TABLES_MAX`] |
//! | block cache | 1 MiB..=64 GiB; default 64 MiB | [`BLOCK_CACHE_BYTES_MIN`], [`BLOCK_CACHE_BYTES_MAX`], [`BLOCK_CACHE_BYTES_DEFAULT`] |
//! | memtable per table | 1 MiB..=1 GiB; default 64 MiB | [`WRITE_BUFFER_BYTES_MIN`], [`WRITE_BUFFER_BYTES_MAX`], [`WRITE_BUFFER_BYTES_DEFAULT`] |
//! | labels added to the metrics ([`EngineBuilder::metrics_label`]) | at most 8; values at most 256 bytes | [`METRICS_LABELS_MAX`], [`METRICS_LABEL_VALUE_BYTES_MAX`] |
//! | periodic compaction | 1 hour..=365 days; default 1 day | [`PERIODIC_COMPACTION_S_MIN`], [`PERIODIC_COMPACTION_S_MAX`], [`PERIODIC_COMPACTION_S_DEFAULT`] |
//! | commit log ([`EngineBuilder::commit_log`]) | 2..=1024 segments of 64 KiB..=4 GiB | [`COMMIT_LOG_SEGMENTS_MIN`], [`COMMIT_LOG_SEGMENTS_MAX`], [`COMMIT_LOG_SEGMENT_BYTES_MIN`], [`COMMIT_LOG_SEGMENT_BYTES_MAX`] |
//!
//! The clock is bounded too: at a reading beyond [`CLOCK_MS_MAX`] (2^62 ms since the Unix epoch) a
//! write returns [`Error::ClockOutOfRange`] and writes nothing, so that no record is born expired.
//! Reads work at any reading.
//!
//! # Flows
//!
//! Each example below runs as a doctest.
//!
//! ## Transactional: marker and business writes in one batch
//!
//! The common case: the message's whole effect is writes to this store. Stage them on the claim;
//! the commit writes them with the marker.
//!
//! ```
//! use idemdb::{Engine, Fingerprint, Outcome, TableOptions, merge_ops};
//!
//! let dir = tempfile::tempdir()?;
//! let engine = Engine::builder(dir.path())
//!     .business_table(TableOptions::new("orders"))
//!     .business_table(TableOptions::new("totals").associative_merge_operator("add_u64", merge_ops::add_u64))
//!     .open()?;
//! let billing = engine.consumer("billing")?;
//! let orders = engine.business_table("orders")?;
//! let totals = engine.business_table("totals")?;
//!
//! for delivery in [&b"order-7:3 apples"[..], b"order-7:3 apples"] {
//!     match billing.begin(b"order-7", Fingerprint::of(delivery))? {
//!         Outcome::Fresh(mut claim) => {
//!             claim.put(&orders, b"order-7", delivery)?;
//!             claim.merge(&totals, b"apples", 3u64.to_be_bytes())?;
//!             claim.commit(b"accepted")?; // marker + both writes, one batch
//!         }
//!         Outcome::Duplicate { result, .. } => assert_eq!(result, "accepted"),
//!         Outcome::InProgress { .. } => { /* nack: the broker redelivers later */ }
//!         Outcome::Conflict { .. } => { /* dead-letter: same id, other content */ }
//!         Outcome::TooLate { .. } => { /* older than retention: dead-letter */ }
//!         Outcome::Stale { .. } => { /* an older version of the entity: ack, skip */ }
//!     }
//! }
//! let apples = totals.get(b"apples")?.and_then(|v| merge_ops::read_u64(&v));
//! assert_eq!(apples, Some(3));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`Consumer::begin_message`] takes a [`Message`] that may also carry its production time (for
//! the admission floor, [`EngineBuilder::admission_floor`]), an entity version (for the ordering
//! guard) and a correlation id (for logs).
//!
//! ## Entity as marker
//!
//! When the effect is "create this entity", the entity record itself can be the marker
//! ([`EngineBuilder::entity_table`], [`EntityTable`]): `begin` on the entity key inserts it if
//! absent, and the committed result *is* the entity. Entity records never expire unless a claim
//! sets an [`Expiry`].
//!
//! ```
//! use idemdb::{Engine, Fingerprint, Outcome};
//!
//! let dir = tempfile::tempdir()?;
//! let engine = Engine::builder(dir.path()).entity_table("customers").open()?;
//! let customers = engine.entity_table("customers")?;
//!
//! let created = br#"{"id":"c-7","name":"Ada"}"#;
//! let reused = br#"{"id":"c-7","name":"Eve"}"#;
//! let (mut inserted, mut duplicates, mut conflicts) = (0, 0, 0);
//! // CustomerCreated delivered twice, then another payload under the same id.
//! for event in [&created[..], &created[..], &reused[..]] {
//!     match customers.begin(b"c-7", Fingerprint::of(event))? {
//!         Outcome::Fresh(claim) => {
//!             claim.commit(event)?; // the entity is the marker
//!             inserted += 1;
//!         }
//!         Outcome::Duplicate { result, .. } => {
//!             assert_eq!(result, &created[..]);
//!             duplicates += 1;
//!         }
//!         Outcome::Conflict { .. } => conflicts += 1, // dead-letter and alert
//!         other => panic!("not expected here: {other:?}"),
//!     }
//! }
//! assert_eq!((inserted, duplicates, conflicts), (1, 1, 1));
//! let stored = customers.get(b"c-7")?.expect("inserted");
//! assert_eq!(stored.result().map(|entity| &entity[..]), Some(&created[..]));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## External two-phase: side effects outside the batch
//!
//! A payment API or another store cannot join the write batch. [`Consumer::begin_external`]
//! writes an in-progress record under a lease, with a fencing epoch and the holder's identity,
//! before it returns (with [`Durability::Sync`], fsynced). The holder performs the effect under a
//! downstream idempotency key ([`ExternalClaim::derive_key`]: the same for every attempt at the
//! message), renews the lease while it works, and then completes (with staged writes, in one
//! batch) or fails ([`FailurePolicy`]: release the key, or record the failure as the result).
//!
//! When a lease runs out, the next `begin` or `begin_external` takes the key over at epoch + 1
//! and learns of the earlier attempt ([`ExternalClaim::previous_attempt`]), whose effect may have
//! been partly applied. Every later step of the old holder returns [`Error::LeaseLost`] and
//! writes nothing, also after a restart ([`ExternalClaim::ticket`], [`Consumer::resume`]).
//! [`Consumer::in_progress`] lists stuck keys and [`Consumer::resolve`] settles them by hand.
//!
//! ```
//! use std::time::Duration;
//! use idemdb::{Engine, Error, FailurePolicy, Fingerprint, MockClock, Outcome};
//!
//! let dir = tempfile::tempdir()?;
//! let clock = MockClock::new(1_767_225_600_000);
//! let engine = Engine::builder(dir.path()).clock(clock.clone()).open()?;
//! let payments = engine.consumer("payments")?;
//! let body = b"charge 42 EUR to card 7";
//! let lease = Duration::from_secs(30);
//!
//! // Worker A takes the key: the in-progress record is on disk before this returns.
//! let Outcome::Fresh(mut a) = payments.begin_external("order-42", Fingerprint::of(body), lease, "worker-a")? else {
//!     panic!("a new store has seen nothing");
//! };
//! assert_eq!(a.epoch(), 1);
//! let charge_key = a.derive_key("charge-card"); // the payment API's Idempotency-Key
//! clock.advance(Duration::from_secs(20));
//! a.renew(lease)?; // heartbeat: the lease now runs 30 s from here
//!
//! // A redelivery while A's lease runs is told who holds the key.
//! let again = payments.begin_external("order-42", Fingerprint::of(body), lease, "worker-b")?;
//! assert!(matches!(again, Outcome::InProgress { epoch: Some(1), .. }));
//!
//! // A stalls past its lease (a long pause, a partition): B takes the key over at epoch 2.
//! clock.advance(Duration::from_secs(31));
//! let Outcome::Fresh(b) = payments.begin_external("order-42", Fingerprint::of(body), lease, "worker-b")? else {
//!     panic!("the lease ran out");
//! };
//! assert_eq!(b.epoch(), 2);
//! assert_eq!(b.previous_attempt().map(|previous| previous.epoch), Some(1)); // it may have charged
//! assert_eq!(b.derive_key("charge-card"), charge_key); // so the API deduplicates B's retry
//!
//! // A's late steps are fenced off and write nothing.
//! assert!(matches!(a.complete(b"charged"), Err(Error::LeaseLost { current_epoch: 2 })));
//! b.complete(b"charged ch_1")?;
//! let later = payments.begin_external("order-42", Fingerprint::of(body), lease, "worker-c")?;
//! assert!(matches!(later, Outcome::Duplicate { ref result, .. } if result == "charged ch_1"));
//!
//! // A permanent failure can be recorded, so that redeliveries replay it instead of retrying.
//! let Outcome::Fresh(c) = payments.begin_external("order-43", Fingerprint::of(b"card 9"), lease, "worker-c")? else {
//!     panic!("new key");
//! };
//! c.fail(FailurePolicy::RecordFailure("card declined".into()))?;
//! let replay = payments.begin("order-43", Fingerprint::of(b"card 9"))?;
//! assert!(matches!(replay, Outcome::Duplicate { succeeded: false, .. }));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Batch: one read and one write for a broker batch
//!
//! [`Consumer::begin_batch`] claims up to [`BATCH_MESSAGES_MAX`] messages with one RocksDB
//! multi-get and gives each a [`BatchOutcome`]; a key repeated inside the batch with the same
//! fingerprint is a duplicate of its first copy, and with another one is never a duplicate
//! ([`BatchOutcome::ConflictInBatch`] when the first copy was claimed). [`ClaimBatch::commit`] writes every claim still held in one write batch: one
//! WAL write and, with [`Durability::Sync`], one fsync.
//!
//! ```
//! use idemdb::{BatchOutcome, Engine, Fingerprint, Message, Outcome, TableOptions};
//!
//! let dir = tempfile::tempdir()?;
//! let engine = Engine::builder(dir.path()).business_table(TableOptions::new("orders")).open()?;
//! let billing = engine.consumer("billing")?;
//! let orders = engine.business_table("orders")?;
//!
//! // One broker batch: order-1 twice (a producer retry), and order-3, whose handler will fail.
//! let deliveries: [(&str, &[u8]); 4] =
//!     [("order-1", b"1 apple"), ("order-2", b"2 pears"), ("order-1", b"1 apple"), ("order-3", b"")];
//! let messages: Vec<Message> = deliveries
//!     .iter()
//!     .map(|(key, body)| Message::new(*key, Fingerprint::of(body)))
//!     .collect();
//! let mut batch = billing.begin_batch(&messages)?;
//! assert!(matches!(batch.outcomes()[2], BatchOutcome::DuplicateInBatch { first: 0 }));
//! for (index, (key, body)) in deliveries.iter().enumerate() {
//!     // DuplicateInBatch: ack; ConflictInBatch (same key, other content): dead-letter;
//!     // Settled outcomes: as for `begin`.
//!     if !matches!(batch.outcomes()[index], BatchOutcome::Fresh) {
//!         continue;
//!     }
//!     if body.is_empty() {
//!         batch.release(index); // the handler failed: nothing is written, the key is free again
//!         continue;
//!     }
//!     if let Some(claim) = batch.claim_mut(index) {
//!         claim.put(&orders, key, body)?;
//!     }
//! }
//! let committed = batch.commit(|_index| b"accepted")?; // every marker and write: one batch
//! assert_eq!(committed.iter().flatten().count(), 2);
//! assert!(orders.get("order-3")?.is_none());
//!
//! // The broker redelivers the whole batch: two duplicates, and order-3 is claimable again.
//! let again = billing.begin_batch(&messages)?;
//! assert!(matches!(again.outcomes()[0], BatchOutcome::Settled(Outcome::Duplicate { .. })));
//! assert!(matches!(again.outcomes()[1], BatchOutcome::Settled(Outcome::Duplicate { .. })));
//! assert!(matches!(again.outcomes()[3], BatchOutcome::Fresh));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Pipeline: several commits in flight from one thread
//!
//! A consumer that waits for each durable commit before it claims the next message leaves the
//! disk idle while it works. [`Consumer::pipeline`] keeps up to `depth` commits in flight and
//! gives each caller's tag back, in the order handed over, once its commit and every one
//! before it are durable ([`Pipeline`]; [`AsyncPipeline`] with feature `tokio`):
//!
//! ```
//! use idemdb::{Engine, Fingerprint, Outcome};
//!
//! let dir = tempfile::tempdir()?;
//! let engine = Engine::builder(dir.path()).open()?;
//! let orders = engine.consumer("orders")?;
//! let mut pipeline = orders.pipeline(4)?;
//! let mut acked = Vec::new();
//! for delivery_tag in 1..=100_u64 {
//!     let key = format!("order-{}", delivery_tag % 90); // 10 redeliveries
//!     match orders.begin(&key, Fingerprint::of(key.as_bytes()))? {
//!         Outcome::Fresh(claim) => pipeline.commit(claim, b"done", delivery_tag),
//!         _ => pipeline.pass(delivery_tag), // acknowledged in its turn
//!     }
//!     for settled in pipeline.settled() {
//!         settled.outcome?;
//!         acked.push(settled.tag);
//!     }
//! }
//! for settled in pipeline.wait() {
//!     settled.outcome?;
//!     acked.push(settled.tag);
//! }
//! assert_eq!(acked, (1..=100).collect::<Vec<_>>());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Log consumer: the read position in the same batch
//!
//! A consumer of a log (a Kafka topic partition, a RabbitMQ stream) restarts from the position
//! it saved, not from what a broker redelivers. Staged with the batch
//! ([`ClaimBatch::stage_position`], or [`Claim::stage_position`] per message), the position
//! is written in the same write batch as the markers and the effects, so a restart resumes
//! exactly after the last message whose effects are stored: none lost, none read again.
//! [`Consumer::positions`] reads it back; a commit behind it is refused
//! ([`Error::PositionBehind`]: a stale reader, nothing written).
//!
//! ```
//! use idemdb::{Engine, Fingerprint, Message, TableOptions};
//!
//! let dir = tempfile::tempdir()?;
//! let engine = Engine::builder(dir.path()).business_table(TableOptions::new("orders")).open()?;
//! let orders_consumer = engine.consumer("orders")?;
//! let orders = engine.business_table("orders")?;
//!
//! // Partition 0 of the log "orders", read from offset 0 (nothing stored yet).
//! let log: [(u64, &str, &str); 3] = [(0, "order-1", "1 apple"), (1, "order-2", "2 pears"), (2, "order-1", "1 apple")];
//! let start = orders_consumer.positions().get("orders", 0)?.map_or(0, |p| p.next_offset());
//! assert_eq!(start, 0);
//! let read: Vec<_> = log.iter().filter(|(offset, ..)| *offset >= start).collect();
//! let messages: Vec<Message> = read.iter().map(|(_, key, body)| Message::new(*key, Fingerprint::of(body))).collect();
//! let mut batch = orders_consumer.begin_batch(&messages)?;
//! for (index, (_, key, body)) in read.iter().enumerate() {
//!     if let Some(claim) = batch.claim_mut(index) {
//!         claim.put(&orders, key, body)?; // offset 2 repeats order-1: no claim, no effect
//!     }
//! }
//! let last = read.last().map_or(0, |(offset, ..)| *offset);
//! batch.stage_position("orders", 0, last)?;
//! batch.commit(|_| b"applied")?; // markers, effects and position: one write batch
//!
//! // After a restart: resume at offset 3.
//! assert_eq!(orders_consumer.positions().get("orders", 0)?.map(|p| p.next_offset()), Some(3));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Webhook: HTTP requests with an idempotency key
//!
//! The same claim serves an HTTP endpoint that receives retried requests under an
//! `Idempotency-Key` header: the response is the claim's result, stored with the request's
//! effects and replayed to every retry. Below, the handler without a server; `examples/webhook/`
//! is the same flow in axum, with [`Claim::commit_async`].
//!
//! ```
//! use idemdb::{BusinessTable, Consumer, Engine, Fingerprint, Outcome, TableOptions, merge_ops};
//!
//! struct Payments {
//!     keys: Consumer,
//!     rows: BusinessTable,
//!     totals: BusinessTable,
//! }
//!
//! /// `POST /payments` with `Idempotency-Key: key`: the response's status and body.
//! fn handle(api: &Payments, key: &str, body: &[u8]) -> idemdb::Result<(u16, Vec<u8>)> {
//!     Ok(match api.keys.begin(key, Fingerprint::of(body))? {
//!         Outcome::Fresh(mut claim) => {
//!             let payment_id = claim.derive_key("payment"); // the same for every retry
//!             claim.put(&api.rows, &payment_id, body)?;
//!             claim.merge(&api.totals, "payments", 1u64.to_be_bytes())?;
//!             let response = (201, format!("{{\"payment_id\":\"{payment_id}\"}}").into_bytes());
//!             claim.commit(encode(&response))?; // the response is stored with the payment
//!             response
//!         }
//!         Outcome::Duplicate { result, .. } => decode(&result), // a retry: replay the response
//!         Outcome::Conflict { .. } => (422, b"this key was used for another body".to_vec()),
//!         Outcome::InProgress { .. } => (409, b"still being processed; retry later".to_vec()),
//!         // Only a `Message` with a production time or an entity version gets these.
//!         Outcome::TooLate { .. } | Outcome::Stale { .. } => (500, Vec::new()),
//!     })
//! }
//!
//! fn encode((status, body): &(u16, Vec<u8>)) -> Vec<u8> {
//!     let mut stored = status.to_be_bytes().to_vec();
//!     stored.extend_from_slice(body);
//!     stored
//! }
//!
//! fn decode(stored: &[u8]) -> (u16, Vec<u8>) {
//!     (u16::from_be_bytes([stored[0], stored[1]]), stored[2..].to_vec())
//! }
//!
//! let dir = tempfile::tempdir()?;
//! let engine = Engine::builder(dir.path())
//!     .retention(std::time::Duration::from_secs(24 * 3600)) // longer than clients retry
//!     .business_table(TableOptions::new("payments"))
//!     .business_table(TableOptions::new("totals").associative_merge_operator("add_u64", merge_ops::add_u64))
//!     .open()?;
//! let api = Payments {
//!     keys: engine.consumer("webhook")?,
//!     rows: engine.business_table("payments")?,
//!     totals: engine.business_table("totals")?,
//! };
//!
//! let first = handle(&api, "8e03978e", b"42 EUR")?;
//! assert_eq!(first.0, 201);
//! assert_eq!(handle(&api, "8e03978e", b"42 EUR")?, first); // retried: the same response
//! assert_eq!(handle(&api, "8e03978e", b"43 EUR")?.0, 422); // key reused for another body
//!
//! // A retry that arrives while the first request still holds its claim:
//! let Outcome::Fresh(in_flight) = api.keys.begin("5c2d", Fingerprint::of(b"7 EUR"))? else {
//!     panic!("new key");
//! };
//! assert_eq!(handle(&api, "5c2d", b"7 EUR")?.0, 409);
//! drop(in_flight); // the first request failed: nothing stored, the next retry runs afresh
//! assert_eq!(handle(&api, "5c2d", b"7 EUR")?.0, 201);
//!
//! let payments = api.totals.get("payments")?.and_then(|v| merge_ops::read_u64(&v));
//! assert_eq!(payments, Some(2)); // two payments for five requests
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Feature flags
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `engine` | on | The RocksDB engine: [`Engine`] and everything built on it, including the operator API [`admin`]. Without it the crate holds only the on-disk format ([`format`](mod@format)) and what it needs ([`Fingerprint`], [`Record`], [`cloudevents_key`], [`merge_ops`], the clocks, [`Error`]), and RocksDB is not compiled; the fuzz targets build it that way. |
//! | `tokio` | off | [`Claim::commit_async`] and [`ClaimBatch::commit_async`], which return a [`CommitFuture`] / [`BatchCommitFuture`] instead of blocking on the log's sync, and [`AsyncPipeline`]. With [`Durability::Sync`] the commit's batch goes to the engine's committer thread (started by the first async or pipelined commit), which writes every commit waiting for it as one group (one log write, one sync) and completes their futures (with the commit log, a second thread applies each durable group to the tables and completes its futures while the committer syncs the next); each commit stays atomic, and if the group's write fails every commit in it gets the error. With [`Durability::Buffered`] the commit is made at once and the future is ready. Dropping the future does not cancel the commit. The application brings its own runtime. |
//! | `cli` | off | The `idemdb` operator binary over [`admin`]: `stats`, `get`, `list`, `in-progress`, `resolve`, `release`, `invalidate`, `purge-expired`, `export`, `import`, `verify`, on a live store (read-only) or a stopped one. |
//!
//! # Observability
//!
//! Every `begin`, commit and lease step emits a `tracing` debug event (target `idemdb`) with
//! the consumer, the key in printable form, the outcome, the epoch and the message's correlation
//! id. Metrics go through the `metrics` facade (labels: `consumer`, and `outcome` for the
//! first, `backend="rocksdb"` (idemdb-postgres reports the same series with
//! `backend="postgres"`), then those the opener added with [`EngineBuilder::metrics_label`],
//! e.g. the partition of a store); [`Engine::stats`] returns the same counts without an exporter:
//!
//! | name | kind | what |
//! |---|---|---|
//! | `idemdb_outcomes_total` | counter | `begin` outcomes: fresh, duplicate, in_progress, conflict, too_late, stale, duplicate_in_batch |
//! | `idemdb_commits_total` | counter | commits and completes that were written |
//! | `idemdb_lease_lost_total` | counter | lease steps refused with `LeaseLost` |
//! | `idemdb_claim_seconds` | histogram | latency of `begin` (and of each batch message's share) |
//! | `idemdb_commit_seconds` | histogram | latency of a commit or complete |
//! | `idemdb_duplicate_age_seconds` | histogram | time since the first commit when a duplicate arrives |
//! | `idemdb_in_progress` | gauge | external claims alive in this process (begun, taken over or resumed; not yet finished or dropped) |
//!
//! Metric handles are registered when a consumer is first asked for, with the recorder
//! installed then: install the recorder before opening consumers. The in-progress gauge
//! counts [`ExternalClaim`]s alive in this process.
//!
//! See `ARCHITECTURE.md` for the write path and `docs/design.md` for the on-disk format.

// The lints the library keeps (CI runs clippy with `-D warnings`). Why each:
#![deny(unsafe_code)] // the engine's safety rests on RocksDB's bindings, not on code of ours
#![warn(missing_docs)] // every public item says what it does and what it refuses
#![warn(clippy::unwrap_used)] // bad input is an error value, never a panic (tests may unwrap)
#![warn(clippy::dbg_macro, clippy::todo, clippy::unimplemented)] // nothing unfinished ships
#![warn(clippy::print_stdout, clippy::print_stderr)] // a library logs through `tracing`
#![warn(clippy::cast_lossless)] // widening casts through `From`, so a narrowing one stands out
#![warn(clippy::semicolon_if_nothing_returned)]
#![warn(clippy::must_use_candidate)] // a value computed for the caller is not dropped silently

// The layers, bottom first (ARCHITECTURE.md, Codemap); each names only its own layer and the
// ones below it (tests/layers.rs).
//
// The format: keys, records, merge operands, the compaction filter's decision, messages, the
// clock and errors. Built with or without RocksDB; its codecs are the public module `format`.
pub mod format;
// Public modules whose files live with the format layer, at the paths users know.
#[path = "format/merge_ops.rs"]
pub mod merge_ops;
// Feature `transfer`: the export line every backend's export writes and import reads.
#[cfg(feature = "transfer")]
#[path = "format/transfer.rs"]
pub mod transfer;
// The pure decision core: the embedded engine's, and every other backend's (idemdb-postgres).
pub mod decision;
// Storage: the open RocksDB store and what it is built from (feature `engine`).
#[cfg(feature = "engine")]
mod storage;
// Operations: claims, batches, leases and the writes they stage (feature `engine`).
#[cfg(feature = "engine")]
mod operations;
// Handles: what the application holds (feature `engine`).
#[cfg(feature = "engine")]
pub mod admin;
#[cfg(feature = "engine")]
mod consumer;
#[cfg(feature = "engine")]
mod engine;

#[cfg(feature = "engine")]
pub use consumer::Consumer;
#[cfg(not(feature = "engine"))]
pub use decision::Outcome;
pub use decision::PreviousAttempt;
#[cfg(feature = "engine")]
pub use engine::{Engine, EntityTable, RecordCounts};
pub use format::clock::{CLOCK_MS_MAX, Clock, MockClock, SystemClock};
pub use format::error::{Error, Limit, Result, StorageErrorKind};
pub use format::fingerprint::Fingerprint;
pub use format::key::{
    CONSUMER_ID_BYTES_MAX, CONSUMER_ID_BYTES_MIN, MESSAGE_KEY_BYTES_MAX, MESSAGE_KEY_BYTES_MIN,
    cloudevents_key,
};
pub use format::message::Message;
pub use format::position::{POSITION_SOURCE_BYTES_MAX, POSITION_SOURCE_BYTES_MIN, Position};
pub use format::record::{
    Committed, EXPIRES_NEVER_MS, HOLDER_BYTES_MAX, LEASE_MS_MAX, LEASE_MS_MIN, RESULT_BYTES_MAX,
    Record, RecordState,
};
#[cfg(feature = "engine")]
pub use operations::batch::{BATCH_MESSAGES_MAX, BatchOutcome, ClaimBatch};
#[cfg(feature = "engine")]
pub use operations::claim::{Claim, Expiry, Outcome};
#[cfg(feature = "engine")]
pub use operations::lease::{
    ExternalClaim, FailurePolicy, InProgressEntry, LeaseTicket, Resolution,
};
#[cfg(all(feature = "engine", feature = "tokio"))]
pub use operations::pipeline::AsyncPipeline;
#[cfg(feature = "engine")]
pub use operations::pipeline::{Durable, PIPELINE_DEPTH_MAX, Pipeline, Settled};
#[cfg(feature = "engine")]
pub use operations::position::Positions;
#[cfg(feature = "engine")]
pub use operations::staging::{
    STAGED_BYTES_MAX, STAGED_WRITES_MAX, TABLE_KEY_BYTES_MAX, TABLE_KEY_BYTES_MIN,
    TABLE_VALUE_BYTES_MAX,
};
#[cfg(feature = "engine")]
pub use storage::business_table::BusinessTable;
#[cfg(feature = "engine")]
pub use storage::fault::{Fault, FaultInjector, IoPoint};
#[cfg(feature = "tokio")]
pub use storage::log::commit_future::{BatchCommitFuture, CommitFuture};
#[cfg(feature = "engine")]
pub use storage::observe::{ConsumerStats, Stats};
#[cfg(feature = "engine")]
pub use storage::options::{
    BLOCK_CACHE_BYTES_DEFAULT, BLOCK_CACHE_BYTES_MAX, BLOCK_CACHE_BYTES_MIN,
    COMMIT_LOG_SEGMENT_BYTES_DEFAULT, COMMIT_LOG_SEGMENT_BYTES_MAX, COMMIT_LOG_SEGMENT_BYTES_MIN,
    COMMIT_LOG_SEGMENTS_MAX, COMMIT_LOG_SEGMENTS_MIN, COMMIT_LOG_SHRINK_AFTER_DEFAULT, Durability,
    EngineBuilder, METRICS_LABEL_VALUE_BYTES_MAX, METRICS_LABELS_MAX,
    PERIODIC_COMPACTION_S_DEFAULT, PERIODIC_COMPACTION_S_MAX, PERIODIC_COMPACTION_S_MIN,
    RETENTION_MS_DEFAULT, RETENTION_MS_MAX, RETENTION_MS_MIN, TABLE_NAME_BYTES_MAX,
    TABLE_NAME_BYTES_MIN, TABLES_MAX, TableMergeFn, TableOptions, WRITE_BUFFER_BYTES_DEFAULT,
    WRITE_BUFFER_BYTES_MAX, WRITE_BUFFER_BYTES_MIN,
};
