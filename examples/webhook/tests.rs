//! Drives the webhook over loopback TCP with a minimal HTTP/1.1 client (`tests/client.rs`)
//! and checks each answer of the header of `main.rs`, and that each delivery's effect was
//! applied at most once.

mod client;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use idemdb_http::KEY_BYTES_MAX;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::payments::ProcessingGate;
use crate::{engine_builder, open_engine};
use client::{Server, payment_request, payments_processed, post, send};

const PAYMENT: &str = r#"{"amount":1250,"currency":"EUR","to":"acct-17"}"#;

#[tokio::test]
async fn first_delivery_is_processed_and_retries_replay_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let engine = open_engine(dir.path()).expect("open");
    let server = Server::start(&engine, None).await;

    let first = post(server.address, "delivery-1", PAYMENT).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed(), "{first:?}");
    assert!(first.body.contains("\"payment_id\":\"idk1-"), "{first:?}");

    // The quoted (structured-field) form names the same key.
    for key in ["delivery-1", "\"delivery-1\""] {
        let retry = post(server.address, key, PAYMENT).await;
        assert_eq!(retry.status, first.status, "{retry:?}");
        assert_eq!(retry.body, first.body);
        assert!(retry.replayed(), "{retry:?}");
    }
    assert_eq!(payments_processed(&engine), 1);

    let count = send(
        server.address,
        b"GET /payments/count HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(count.status, 200, "{count:?}");
    assert_eq!(count.body, r#"{"payments":1}"#);

    // Another key is another payment.
    let second = post(server.address, "delivery-2", PAYMENT).await;
    assert_eq!(second.status, 201, "{second:?}");
    assert!(!second.replayed());
    assert_ne!(second.body, first.body);
    assert_eq!(payments_processed(&engine), 2);
    server.stop().await;
}

#[tokio::test]
async fn same_key_with_another_body_is_422_without_effect() {
    let dir = tempfile::tempdir().expect("temp dir");
    let engine = open_engine(dir.path()).expect("open");
    let server = Server::start(&engine, None).await;

    let first = post(server.address, "delivery-1", PAYMENT).await;
    assert_eq!(first.status, 201, "{first:?}");
    let other = post(server.address, "delivery-1", r#"{"amount":9999}"#).await;
    assert_eq!(other.status, 422, "{other:?}");
    assert!(!other.replayed());
    assert!(other.body.contains("different request"), "{other:?}");
    assert_eq!(payments_processed(&engine), 1);

    // The conflict changed nothing: the original body still replays.
    let retry = post(server.address, "delivery-1", PAYMENT).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    server.stop().await;
}

#[tokio::test]
async fn retry_while_the_first_is_processed_is_409_then_replays() {
    let dir = tempfile::tempdir().expect("temp dir");
    let engine = open_engine(dir.path()).expect("open");
    let gate = Arc::new(ProcessingGate::default());
    let server = Server::start(&engine, Some(gate.clone())).await;
    let address = server.address;

    let first = tokio::spawn(async move { post(address, "delivery-1", PAYMENT).await });
    // The first request now holds its claim and waits at the gate.
    gate.reached.notified().await;
    for body in [PAYMENT, r#"{"amount":9999}"#] {
        // The latch cannot tell a retry from a conflicting reuse until the first completes.
        // A retry that got through to processing would wait at the gate: fail, not hang.
        let busy = tokio::select! {
            busy = post(address, "delivery-1", body) => busy,
            () = gate.reached.notified() => panic!("a retry was processed during the first"),
        };
        assert_eq!(busy.status, 409, "{busy:?}");
        assert_eq!(busy.header("retry-after"), Some("1"), "{busy:?}");
        assert!(!busy.replayed());
    }
    assert_eq!(payments_processed(&engine), 0);

    gate.release.notify_one();
    let first = first.await.expect("first request");
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());

    // Replays do not reach the gate: nothing is processed for them.
    let retry = post(address, "delivery-1", PAYMENT).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(payments_processed(&engine), 1);
    server.stop().await;
}

#[tokio::test]
async fn client_gone_during_processing_writes_nothing_and_frees_the_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let engine = open_engine(dir.path()).expect("open");
    let gate = Arc::new(ProcessingGate::default());
    let server = Server::start(&engine, Some(gate.clone())).await;

    let mut stream = TcpStream::connect(server.address).await.expect("connect");
    stream
        .write_all(&payment_request(&["delivery-1"], PAYMENT))
        .await
        .expect("write request");
    gate.reached.notified().await;
    assert_eq!(engine.open_claims(), 1);
    // The client gives up: hyper sees the connection close and drops the handler's future,
    // and with it the claim. There is no event to await for that, so yield to the server
    // until it happens (a hang here means the claim outlived its request).
    drop(stream);
    while engine.open_claims() != 0 {
        tokio::task::yield_now().await;
    }
    assert_eq!(payments_processed(&engine), 0);

    // The key is free: the retry is processed, not answered 409 or replayed.
    gate.release.notify_one();
    let retry = post(server.address, "delivery-1", PAYMENT).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed(), "{retry:?}");
    assert_eq!(payments_processed(&engine), 1);
    server.stop().await;
}

#[tokio::test]
async fn missing_or_unusable_key_is_400() {
    let dir = tempfile::tempdir().expect("temp dir");
    let engine = open_engine(dir.path()).expect("open");
    let server = Server::start(&engine, None).await;

    let too_long = "k".repeat(KEY_BYTES_MAX + 1);
    let longest = "k".repeat(KEY_BYTES_MAX);
    let cases: [(&[&str], &str); 5] = [
        (&[], "required"),
        (&["\"\""], "1 to 255 ASCII characters"),
        (&[too_long.as_str()], "1 to 255 ASCII characters"),
        (&["two words"], "1 to 255 ASCII characters"),
        (&["delivery-1", "delivery-2"], "exactly one"),
    ];
    for (keys, reason) in cases {
        let reply = send(server.address, &payment_request(keys, PAYMENT)).await;
        assert_eq!(reply.status, 400, "{keys:?}: {reply:?}");
        assert!(reply.body.contains(reason), "{keys:?}: {reply:?}");
    }
    assert_eq!(payments_processed(&engine), 0);

    // The server is still up, and the longest allowed key works.
    let reply = post(server.address, &longest, PAYMENT).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(payments_processed(&engine), 1);
    server.stop().await;
}

#[tokio::test]
async fn responses_replay_after_the_store_is_reopened() {
    let dir = tempfile::tempdir().expect("temp dir");
    let first = {
        let engine = open_engine(dir.path()).expect("open");
        let server = Server::start(&engine, None).await;
        let first = post(server.address, "delivery-1", PAYMENT).await;
        assert_eq!(first.status, 201, "{first:?}");
        server.stop().await;
        first
        // The engine is dropped here, closing the store.
    };

    let engine = open_engine(dir.path()).expect("reopen");
    let server = Server::start(&engine, None).await;
    let retry = post(server.address, "delivery-1", PAYMENT).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    let other = post(server.address, "delivery-1", r#"{"amount":9999}"#).await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(payments_processed(&engine), 1);
    server.stop().await;
}

/// Makes every write fail while armed, as a failing disk would.
#[derive(Clone, Debug, Default)]
struct FailingWrites {
    armed: Arc<AtomicBool>,
}

impl idemdb::FaultInjector for FailingWrites {
    fn fault(&self, point: idemdb::IoPoint) -> idemdb::Fault {
        if point == idemdb::IoPoint::Write && self.armed.load(Ordering::SeqCst) {
            idemdb::Fault::FailBefore
        } else {
            idemdb::Fault::None
        }
    }
}

#[tokio::test]
async fn failed_commit_stores_nothing_and_the_retry_is_processed() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let faults = FailingWrites::default();
        let engine = engine_builder(dir.path())
            .fault_injector(faults.clone())
            .open()
            .expect("open");
        let server = Server::start(&engine, None).await;
        faults.armed.store(true, Ordering::SeqCst);
        let failed = post(server.address, "delivery-1", PAYMENT).await;
        assert_eq!(failed.status, 503, "{failed:?}");
        // The failed write poisoned the engine: the store refuses writes until reopened,
        // and the retry is refused too rather than replayed or half applied.
        faults.armed.store(false, Ordering::SeqCst);
        let refused = post(server.address, "delivery-1", PAYMENT).await;
        assert_eq!(refused.status, 503, "{refused:?}");
        assert_eq!(payments_processed(&engine), 0);
        server.stop().await;
    }

    let engine = open_engine(dir.path()).expect("reopen");
    let server = Server::start(&engine, None).await;
    let retry = post(server.address, "delivery-1", PAYMENT).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(
        !retry.replayed(),
        "nothing was stored for the failed attempt"
    );
    assert_eq!(payments_processed(&engine), 1);
    server.stop().await;
}
