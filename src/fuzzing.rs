//! Entry points for the coverage-guided fuzzer (`tests/fuzz`, cargo-fuzz) and for the test that
//! replays its committed seeds (`tests/fuzz_seeds.rs`): one function per surface that reads
//! bytes from outside the process (the frame codec, the JSON-RPC connection and the typed
//! messages it hands on, session events, the transcript reader, the HTTP API's request
//! bodies). Each takes arbitrary bytes, drives the real code with them, and panics only when
//! an invariant of that code is broken (a reservation larger than what arrived, a frame that
//! does not survive re-encoding, a request answered twice, a duplicate transcript line, ...);
//! anything the code refuses with an error is a pass.
//!
//! Not part of the crate's API: hidden from the documentation, and nothing in the crate
//! calls it.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::codec::{Decoder, Encoder};

use crate::rpc::SessionEvent;
use crate::rpc::codec::{DEFAULT_MAX_FRAME_BYTES, FrameCodec, MAX_RESERVE_AHEAD_BYTES};
use crate::rpc::connection::{
    Connection, ConnectionOptions, ErrorObject, INTERNAL_ERROR, Incoming, RpcError,
};
use crate::rpc::messages::{HookInvocation, HttpRequestChunk, HttpRequestStart, UserInputRequest};
use crate::transcript::{
    Entry, Role, Transcript, TranscriptCache, TranscriptMode, count_duplicates, transcript_path,
};

/// Frames of the JSON-RPC target above this size are refused (a small limit, so the fuzzer
/// reaches the too-large path with small inputs).
const RPC_MAX_FRAME_BYTES: usize = 64 * 1024;

/// Cuts `data` into frames the way the connection's reader does: the first byte chooses the
/// size of the pieces the bytes arrive in (1 to 64) and the frame limit (64 MiB or 1 KiB);
/// the rest is the stream. Checks that the decoder's buffer never holds much more than what
/// arrived (a huge `Content-Length` must not allocate), and that every frame it cuts is cut
/// again, unchanged, from its re-encoding.
pub fn frame_codec(data: &[u8]) {
    let Some((&control, stream)) = data.split_first() else {
        return;
    };
    let piece_len = usize::from(control & 0x3f) + 1;
    let max = if control & 0x40 == 0 {
        DEFAULT_MAX_FRAME_BYTES
    } else {
        1024
    };
    let mut codec = FrameCodec::new(max);
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    let mut arrived = 0usize;
    let mut broken = false;
    'stream: for piece in stream.chunks(piece_len) {
        buf.extend_from_slice(piece);
        arrived += piece.len();
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                Err(_) => {
                    broken = true;
                    break 'stream;
                }
            }
        }
        // The read-ahead kept free, and growth by doubling: at most twice both.
        let bound = 2 * (arrived + MAX_RESERVE_AHEAD_BYTES);
        assert!(
            buf.capacity() <= bound,
            "the decoder holds {} bytes of buffer after {arrived} bytes arrived (bound {bound})",
            buf.capacity()
        );
    }
    if !broken {
        while let Ok(Some(frame)) = codec.decode_eof(&mut buf) {
            frames.push(frame);
        }
    }
    let total: usize = frames.iter().map(Bytes::len).sum();
    assert!(total <= arrived, "frames hold more bytes than arrived");

    let mut encoded = BytesMut::new();
    let mut encoder = FrameCodec::new(max);
    for frame in &frames {
        if let Err(e) = encoder.encode(frame.clone(), &mut encoded) {
            panic!("a frame the decoder accepted does not encode: {e}");
        }
    }
    let mut again = Vec::new();
    let mut decoder = FrameCodec::new(max);
    loop {
        match decoder.decode(&mut encoded) {
            Ok(Some(frame)) => again.push(frame),
            Ok(None) => break,
            Err(e) => panic!("a re-encoded frame does not decode: {e}"),
        }
    }
    assert!(encoded.is_empty(), "bytes left after the re-encoded frames");
    assert_eq!(again, frames, "frames changed through encode and decode");
}

/// Feeds `data` as the peer's byte stream into a real [`Connection`] (with three of our own
/// requests waiting for answers), answers every request the peer makes the way the worker
/// does (typed params for the methods it knows, an error or nothing otherwise), decodes every
/// `session.event`, and reads back all the connection wrote. Checks that the connection
/// closes, that our waiting requests all end (answered or closed, never timed out), that
/// every frame it wrote is JSON-RPC 2.0, and that no request is answered twice or answered
/// without having been asked. Runs twice, with and without
/// [`ConnectionOptions::split_session_events`], and checks that the owner is handed the same
/// in both (a split event as what a notification's params read as an event give); then
/// once more with [`ConnectionOptions::max_frame_values`] set low, under the same checks.
pub fn json_rpc(data: &[u8]) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => panic!("cannot build a tokio runtime for the JSON-RPC target: {e}"),
    };
    let whole = runtime.block_on(json_rpc_run(data, false, None));
    let split = runtime.block_on(json_rpc_run(data, true, None));
    assert_eq!(
        whole, split,
        "splitting session events off changed what the owner is handed"
    );
    // And as the SDK endpoint reads a client, with a bound on each frame's values that
    // small frames pass (what it hands on differs: only that it stands is checked).
    runtime.block_on(json_rpc_run(data, false, Some(16)));
}

/// What reached the owner, in order, in a form both ways of reading events agree on.
#[derive(Debug, PartialEq)]
enum Handed {
    Request { method: String, params: Value },
    Notification { method: String, params: String },
    Event { session_id: String, event: String },
    Closed(String),
}

async fn json_rpc_run(
    data: &[u8],
    split_session_events: bool,
    max_frame_values: Option<usize>,
) -> Vec<Handed> {
    let (ours, peer) = tokio::io::duplex(16 * 1024);
    let (our_read, our_write) = tokio::io::split(ours);
    let (mut peer_read, mut peer_write) = tokio::io::split(peer);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let options = ConnectionOptions {
        max_frame_bytes: RPC_MAX_FRAME_BYTES,
        default_timeout: Duration::from_secs(30),
        split_session_events,
        max_frame_values,
        ..ConnectionOptions::default()
    };
    let conn = Connection::start(
        our_read,
        our_write,
        options,
        Box::new(move |incoming| {
            let _ = tx.send(incoming);
        }),
    );
    // What the connection writes, read to its end (it ends once the connection is dropped).
    let written = tokio::spawn(async move {
        let mut out = Vec::new();
        let _ = peer_read.read_to_end(&mut out).await;
        out
    });
    let mut calls = Vec::new();
    for _ in 0..3 {
        let conn = conn.clone();
        calls.push(tokio::spawn(async move {
            conn.request("fuzz.call", json!({}), None).await
        }));
    }
    // Let the three requests take ids 1, 2 and 3 before the peer's bytes arrive.
    tokio::task::yield_now().await;
    let feed = {
        let data = data.to_vec();
        tokio::spawn(async move {
            let _ = peer_write.write_all(&data).await;
            let _ = peer_write.shutdown().await;
        })
    };

    let mut asked = HashSet::new();
    let mut closes = 0;
    let mut handed = Vec::new();
    while let Some(incoming) = rx.recv().await {
        match incoming {
            Incoming::Request(request) => {
                handed.push(Handed::Request {
                    method: request.method.clone(),
                    params: request.params.clone(),
                });
                let id = request.responder.id().cloned();
                assert!(
                    id.is_some(),
                    "a request reached the sink without an id: {:?}",
                    request.method
                );
                if let Some(id) = id {
                    asked.insert(id.to_string());
                }
                answer(request);
            }
            Incoming::Notification { method, params } => {
                let event = (method == "session.event")
                    .then(|| serde_json::from_str::<crate::rpc::events::EventParams>(params.get()))
                    .and_then(Result::ok);
                match event {
                    Some(event) => {
                        let text = event.event.unwrap_or(RawValue::NULL).get().to_owned();
                        handed.push(Handed::Event {
                            session_id: event.session_id.clone(),
                            event: text,
                        });
                        check_event(event.event().into_raw());
                    }
                    None => handed.push(Handed::Notification {
                        method,
                        params: params.get().to_owned(),
                    }),
                }
            }
            Incoming::SessionEvent { session_id, event } => {
                handed.push(Handed::Event {
                    session_id,
                    event: event.get().to_owned(),
                });
                check_event(event);
            }
            Incoming::Closed(cause) => {
                handed.push(Handed::Closed(cause.to_string()));
                closes += 1;
                break;
            }
        }
    }
    assert_eq!(
        closes, 1,
        "the connection must report its close exactly once"
    );
    for call in calls {
        match call.await {
            Ok(Err(RpcError::Timeout { .. })) => {
                panic!("a request of ours outlived the connection and timed out")
            }
            Ok(_) => {}
            Err(e) => panic!("a request task failed: {e}"),
        }
    }
    let _ = feed.await;
    drop(conn);
    let out = match written.await {
        Ok(out) => out,
        Err(e) => panic!("the reader of the connection's output failed: {e}"),
    };
    let mut decoder = FrameCodec::new(RPC_MAX_FRAME_BYTES);
    let mut out = BytesMut::from(&out[..]);
    let mut answered = HashSet::new();
    loop {
        let frame = match decoder.decode_eof(&mut out) {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(e) => panic!("the connection wrote a broken frame: {e}"),
        };
        let message: Value = match serde_json::from_slice(&frame) {
            Ok(message) => message,
            Err(e) => panic!("the connection wrote a frame that is not JSON: {e}"),
        };
        assert_eq!(message.get("jsonrpc"), Some(&json!("2.0")), "{message}");
        if message.get("method").is_some() {
            assert_eq!(message["method"], "fuzz.call", "{message}");
            continue;
        }
        let id = message.get("id").map(Value::to_string).unwrap_or_default();
        assert!(
            message.get("result").is_some() != message.get("error").is_some(),
            "a response needs exactly one of result and error: {message}"
        );
        // A request over the value bound is answered by the connection, never handed on.
        let refused_unread = max_frame_values.is_some()
            && message["error"]["code"] == crate::rpc::connection::INVALID_REQUEST;
        assert!(
            asked.contains(&id) || refused_unread,
            "answered a request never asked: {message}"
        );
        assert!(answered.insert(id), "answered a request twice: {message}");
    }
    handed
}

/// Answers a request from the peer as the worker would: typed params for the methods whose
/// params it reads, then a result, an error, or nothing (the responder's drop answers).
fn answer(request: crate::rpc::IncomingRequest) {
    let typed = match request.method.as_str() {
        "userInput.request" => serde_json::from_value::<UserInputRequest>(request.params.clone())
            .map(|p| p.session_id.len()),
        "hooks.invoke" => serde_json::from_value::<HookInvocation>(request.params.clone())
            .map(|p| p.session_id.len()),
        "llmInference.httpRequestStart" => {
            serde_json::from_value::<HttpRequestStart>(request.params.clone()).map(|_| 0)
        }
        "llmInference.httpRequestChunk" => {
            serde_json::from_value::<HttpRequestChunk>(request.params.clone()).map(|_| 0)
        }
        _ => {
            let choice = request.method.len() % 3;
            match choice {
                0 => request.responder.method_not_found(),
                1 => request.responder.ok(json!({"echo": request.params})),
                _ => drop(request.responder),
            }
            return;
        }
    };
    match typed {
        Ok(_) => request.responder.ok(json!({})),
        Err(e) => request
            .responder
            .err(ErrorObject::new(INTERNAL_ERROR, e.to_string())),
    }
}

/// Decodes `data` as the JSON of one session event. Checks that the event keeps what was
/// sent, and that its wire form decodes to the same typed event.
pub fn session_event(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(raw) = serde_json::value::RawValue::from_string(text.to_owned()) else {
        return;
    };
    check_event(raw);
}

fn check_event(raw: Box<serde_json::value::RawValue>) {
    let sent = raw.get().to_owned();
    let event = SessionEvent::from_raw(raw);
    assert_eq!(event.raw().get(), sent, "the event must keep what was sent");
    let wire = event.to_value();
    if let Err(e) = serde_json::to_vec(&wire) {
        panic!("a decoded event does not serialize: {e}");
    }
    let again = SessionEvent::from_value(wire);
    assert_eq!(
        again.kind, event.kind,
        "the event's wire form decodes to another event"
    );
    assert_eq!(again.event_type(), event.event_type());
}

/// Writes `data` as the transcript file of a session in `dir` (a scratch directory the caller
/// owns) and opens it as the pool does after a crash. Checks that the open leaves only
/// complete lines, that an append is written once however often it is repeated, that it
/// adds no duplicate, and that a reopen through the cache finds what a full read finds.
pub fn transcript_reader(dir: &Path, data: &[u8]) {
    const SESSION: &str = "fuzz-session";
    let path = match transcript_path(dir, SESSION) {
        Ok(path) => path,
        Err(e) => panic!("the fuzz session id is refused: {e}"),
    };
    if let Err(e) = std::fs::write(&path, data) {
        panic!("cannot write {}: {e}", path.display());
    }
    let duplicates = count_duplicates(&path).ok();
    let cache = TranscriptCache::new();
    let mut transcript = match Transcript::open_cached(dir, SESSION, TranscriptMode::Strict, &cache)
    {
        Ok(transcript) => transcript,
        Err(e) => panic!("a transcript file with any content must open: {e}"),
    };
    let on_disk = std::fs::read(&path).unwrap_or_default();
    assert!(
        on_disk.is_empty() || on_disk.ends_with(b"\n"),
        "the open left a partial last line"
    );
    assert!(
        data.starts_with(&on_disk),
        "the open changed complete lines"
    );
    let entry = Entry::new(Role::User, "fuzz").with_event_id("fuzz-entry-id");
    let known = transcript.contains("fuzz-entry-id");
    match transcript.append(&entry) {
        Ok(written) => assert_eq!(written, !known, "an append must write an id not yet there"),
        Err(e) => panic!("an append to a scratch transcript failed: {e}"),
    }
    match transcript.append(&entry) {
        Ok(written) => assert!(!written, "the same entry was written twice"),
        Err(e) => panic!("an append to a scratch transcript failed: {e}"),
    }
    let ids = transcript.len();
    drop(transcript);
    assert_eq!(
        count_duplicates(&path).ok(),
        duplicates,
        "an append added a duplicate line"
    );
    let cached = match Transcript::open_cached(dir, SESSION, TranscriptMode::Strict, &cache) {
        Ok(transcript) => transcript,
        Err(e) => panic!("a transcript this process wrote must reopen: {e}"),
    };
    let full = match Transcript::open(dir, SESSION, TranscriptMode::Strict) {
        Ok(transcript) => transcript,
        Err(e) => panic!("a transcript this process wrote must reopen: {e}"),
    };
    assert_eq!(cached.len(), ids, "the cached reopen lost or invented ids");
    assert_eq!(full.len(), ids, "the full reopen lost or invented ids");
    assert!(full.contains("fuzz-entry-id"));
    drop(cached);
    drop(full);
    let _ = std::fs::remove_file(&path);
}

/// Parses `data` as each request body of the HTTP API (`POST /v1/turns`, compact, reset) and
/// runs the checks a request goes through before anything is leased (tools, attachments,
/// provider, session options and their directories, credentials), without a pool.
#[cfg(feature = "http")]
pub fn http_body(data: &[u8]) {
    crate::http::fuzz_request_bodies(data);
}
