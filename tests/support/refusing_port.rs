//! A loopback port that refuses connections for as long as the test holds it.

/// A port bound on 127.0.0.1 with no listener: a connection to it is refused at once, and
/// while the value lives no other test can be given the port (a port that was merely free a
/// moment ago can be handed to another test's listener, which then answers or hangs).
pub struct RefusingPort {
    _socket: tokio::net::TcpSocket,
    port: u16,
}

impl RefusingPort {
    pub fn new() -> RefusingPort {
        let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
        socket
            .bind(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind a loopback port");
        let port = socket.local_addr().expect("its address").port();
        RefusingPort {
            _socket: socket,
            port,
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}
