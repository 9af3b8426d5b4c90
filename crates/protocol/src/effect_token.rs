//! The wire form of an admission token: `EPOCH.SERIAL.MAC`, the kernel's token (the run's epoch
//! at admission and a serial unique in the run) sealed with 128 bits of HMAC-SHA256 over the
//! effect's identity under a key only the daemon holds. The kernel's serials are sequential, so
//! without the seal a token could be guessed; with it, a token is proof that the gate issued it
//! for this run and key. The gate opens it before anything else reads it: a token that was not
//! sealed for this effect is `bad_token`, never a kernel lookup.

use estop_kernel::Token;
use estop_kernel::ids::{EffectKey, RunId};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of the MAC a token carries (hex on the wire: twice as many digits).
pub const MAC_BYTES: usize = 16;

/// The daemon's sealing key. `Debug` never shows it.
#[derive(Clone)]
pub struct TokenSeal([u8; 32]);

impl std::fmt::Debug for TokenSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenSeal(..)")
    }
}

impl TokenSeal {
    pub fn new(key: [u8; 32]) -> TokenSeal {
        TokenSeal(key)
    }

    /// A key of zeros: for tests and the simulation, which never face a guesser. The daemon
    /// always seals with its own random key (`DATA/effect-token.key`, or the PostgreSQL
    /// store's `estop_secret`).
    pub fn for_tests() -> TokenSeal {
        TokenSeal([0; 32])
    }

    fn mac(&self, run: &RunId, key: &EffectKey, t: Token) -> [u8; MAC_BYTES] {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("any key length");
        // Lengths first, so no two identities share an input.
        for part in [run.as_str(), key.as_str()] {
            m.update(&(part.len() as u64).to_le_bytes());
            m.update(part.as_bytes());
        }
        m.update(&t.epoch.to_le_bytes());
        m.update(&t.serial.to_le_bytes());
        let full = m.finalize().into_bytes();
        let mut out = [0; MAC_BYTES];
        out.copy_from_slice(&full[..MAC_BYTES]);
        out
    }

    /// The token as the gate hands it out for effect `key` of `run`.
    pub fn seal(&self, run: &RunId, key: &EffectKey, t: Token) -> String {
        let mac: String = self
            .mac(run, key, t)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("{t}.{mac}")
    }

    /// The kernel's token in `wire`, if the gate sealed it for effect `key` of `run`.
    pub fn open(&self, run: &RunId, key: &EffectKey, wire: &str) -> Option<Token> {
        let (plain, mac) = wire.rsplit_once('.')?;
        let t = Token::parse(plain)?;
        if mac.len() != 2 * MAC_BYTES {
            return None;
        }
        let mut given = [0u8; MAC_BYTES];
        for (i, b) in given.iter_mut().enumerate() {
            *b = u8::from_str_radix(mac.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        // Constant time: a guesser learns nothing from how long a wrong MAC took.
        let diff = self
            .mac(run, key, t)
            .iter()
            .zip(given)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        (diff == 0).then_some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(run: &str, key: &str) -> (RunId, EffectKey) {
        (RunId::new(run).unwrap(), EffectKey::new(key).unwrap())
    }

    /// A sealed token opens for its own effect only, under its own key only; the kernel's bare
    /// `epoch.serial`, a changed digit and a token of another run or key are refused.
    #[test]
    fn a_token_opens_only_for_the_effect_it_was_sealed_for() {
        let seal = TokenSeal::new([7; 32]);
        let (run, key) = ids("order-42", "idem:x1");
        let t = Token {
            epoch: 1,
            serial: 2,
        };
        let wire = seal.seal(&run, &key, t);
        assert_eq!(wire.len(), "1.2.".len() + 2 * MAC_BYTES);
        assert_eq!(seal.open(&run, &key, &wire), Some(t));
        assert_eq!(seal.open(&run, &key, "1.2"), None, "unsealed");
        let (other_run, other_key) = ids("order-43", "idem:x2");
        assert_eq!(seal.open(&other_run, &key, &wire), None);
        assert_eq!(seal.open(&run, &other_key, &wire), None);
        assert_eq!(TokenSeal::new([8; 32]).open(&run, &key, &wire), None);
        let mut flipped = wire.clone().into_bytes();
        let last = flipped.len() - 1;
        flipped[last] = if flipped[last] == b'0' { b'1' } else { b'0' };
        assert_eq!(
            seal.open(&run, &key, std::str::from_utf8(&flipped).unwrap()),
            None
        );
        // The same MAC on another serial does not open.
        let mac = wire.rsplit_once('.').unwrap().1;
        assert_eq!(seal.open(&run, &key, &format!("1.3.{mac}")), None);
        for junk in ["", ".", "1.2.", "1.2.zz", "a.b.c", "1.2.ÿÿ"] {
            assert_eq!(seal.open(&run, &key, junk), None, "{junk:?}");
        }
    }
}
