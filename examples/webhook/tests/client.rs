//! The loopback server and the minimal HTTP/1.1 client the tests drive it with.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use idemdb::{Engine, merge_ops};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::payments::{ProcessingGate, router};
use crate::{PAYMENTS_COUNTER, TOTALS_TABLE};

/// A server on an ephemeral loopback port.
pub(crate) struct Server {
    pub(crate) address: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    pub(crate) async fn start(engine: &Engine, gate: Option<Arc<ProcessingGate>>) -> Server {
        let app = router(engine, gate).expect("router");
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind");
        let address = listener.local_addr().expect("local address");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
        });
        Server {
            address,
            stop,
            task,
        }
    }

    /// Stops serving and waits until the router (and its engine handles) is dropped.
    pub(crate) async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.expect("server task").expect("server");
    }
}

/// An HTTP response, as the test client read it.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    /// Header names in lower case.
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(candidate, _)| candidate == name)
            .map(|(_, value)| value.as_str())
    }

    pub(crate) fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// A `POST /payments` request with `keys` as its `Idempotency-Key` headers.
pub(crate) fn payment_request(keys: &[&str], body: &str) -> Vec<u8> {
    let mut request = format!(
        "POST /payments HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for key in keys {
        request.push_str(&format!("Idempotency-Key: {key}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    request.into_bytes()
}

/// Sends one request on a new connection and reads the response until the server closes
/// the connection (`Connection: close`).
pub(crate) async fn send(address: SocketAddr, request: &[u8]) -> Reply {
    let mut stream = TcpStream::connect(address).await.expect("connect");
    stream.write_all(request).await.expect("write request");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read response");
    parse_reply(&raw)
}

fn parse_reply(raw: &[u8]) -> Reply {
    let text = std::str::from_utf8(raw).expect("UTF-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("response head");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .map(|line| {
            let (name, value) = line.split_once(':').expect("header line");
            (name.to_ascii_lowercase(), value.trim().to_owned())
        })
        .collect();
    let reply = Reply {
        status,
        headers,
        body: body.to_owned(),
    };
    // The body is read to the end of the connection; a chunked body would need decoding.
    assert_eq!(reply.header("transfer-encoding"), None, "{reply:?}");
    reply
}

pub(crate) async fn post(address: SocketAddr, key: &str, body: &str) -> Reply {
    send(address, &payment_request(&[key], body)).await
}

/// The effect count: payments processed, read from the store itself.
pub(crate) fn payments_processed(engine: &Engine) -> u64 {
    let totals = engine.business_table(TOTALS_TABLE).expect("totals table");
    let value = totals.get(PAYMENTS_COUNTER).expect("read the counter");
    value.as_deref().and_then(merge_ops::read_u64).unwrap_or(0)
}
