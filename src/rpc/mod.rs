//! The wire: `Content-Length` framing, the JSON-RPC 2.0 connection, typed messages and
//! session events. This module knows nothing about processes, workers or pools.

pub mod codec;
pub mod connection;
pub mod events;
pub(crate) mod gate;
pub mod introspect;
pub mod messages;

pub use codec::{DEFAULT_MAX_FRAME_BYTES, FrameCodec, FrameError};
pub use connection::{
    CloseCause, Connection, ConnectionOptions, ErrorObject, Incoming, IncomingRequest, PeerLimits,
    Responder, RpcError,
};
pub use events::{EventKind, SessionEvent};
pub use gate::{UnreadEvents, unread_by_the_pool};
pub use messages::{Method, PROTOCOL_VERSION};
