//! Reading a Prometheus endpoint the way a monitoring system does, for the examples that serve
//! one (the demo scrapes itself; the RabbitMQ checker scrapes a consumer).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

/// The body of `GET /metrics` from `addr` (plain HTTP/1.0 over loopback).
pub fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(match response.split_once("\r\n\r\n") {
        Some((_, body)) => body.to_owned(),
        None => response,
    })
}
