//! The DNS stub inside the sandbox (`nameserver 127.0.0.1`): every query is answered REFUSED,
//! so a lookup fails at once instead of timing out, and no name ever leaves the sandbox through
//! DNS (names reach the world only as the host of a request the gate admitted).

use tokio::net::UdpSocket;

/// Answers every query on `sock` with REFUSED until the socket fails.
pub async fn serve(sock: UdpSocket) {
    let mut buf = [0u8; 512];
    while let Ok((n, peer)) = sock.recv_from(&mut buf).await {
        if let Some(reply) = refuse(&buf[..n]) {
            let _ = sock.send_to(&reply, peer).await;
        }
    }
}

/// The REFUSED answer to one query: its header and question, QR set, RCODE 5, no records.
pub fn refuse(query: &[u8]) -> Option<Vec<u8>> {
    if query.len() < 12 || query[2] & 0x80 != 0 {
        return None; // too short, or a response: not ours to answer
    }
    let mut reply = query.to_vec();
    reply[2] = 0x80 | (query[2] & 0x79); // QR, the opcode and RD as asked
    reply[3] = 0x05; // RCODE REFUSED
    reply[6..12].fill(0); // no answers, authorities or additionals (the question stays)
    // Keep the question section only: drop additional records (EDNS) after it.
    let qd = u16::from_be_bytes([query[4], query[5]]);
    let mut end = 12;
    for _ in 0..qd {
        while end < reply.len() && reply[end] != 0 {
            end += 1 + usize::from(reply[end]);
        }
        end += 5; // the root label, QTYPE, QCLASS
    }
    if end > reply.len() {
        return None;
    }
    reply.truncate(end);
    Some(reply)
}

#[cfg(test)]
mod tests {
    #[test]
    fn refuses_a_query_with_its_question() {
        // id 0x1234, RD, one question: example.com A IN
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 1];
        q.extend(b"\x07example\x03com\x00\x00\x01\x00\x01");
        q.extend([0, 0, 41, 16, 0, 0, 0, 0, 0, 0, 0]); // an EDNS OPT record
        let r = super::refuse(&q).unwrap();
        assert_eq!(&r[..4], &[0x12, 0x34, 0x81, 0x05]);
        assert_eq!(&r[4..12], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&r[12..], b"\x07example\x03com\x00\x00\x01\x00\x01");
        assert!(super::refuse(&r).is_none(), "a response is not answered");
        assert!(super::refuse(&q[..5]).is_none());
    }
}
