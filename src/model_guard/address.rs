//! Which IP addresses a model request may connect to: every address is classified against
//! the special-purpose ranges of IPv4 and IPv6 (IANA's registries), with the IPv4 address
//! inside an IPv4-mapped, IPv4-compatible, 6to4 or NAT64 IPv6 address classified as itself.
//!
//! [`classify`] answers `None` for an ordinary (global unicast) address and the range an
//! address falls in otherwise; [`allowed`] decides with the pool's `allow_private_endpoints`
//! switch: loopback, private, shared (CGNAT), link-local and unique-local ranges are allowed
//! only with it, and the cloud metadata addresses, unspecified, multicast, broadcast,
//! documentation and reserved ranges never. [`is_this_host`] tells this machine's own
//! addresses (which no range marks), refused by the guard on the same terms as private ones.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};

use crate::kinds::BlockReason;

/// The special-purpose range an address falls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressClass {
    /// `127.0.0.0/8`, `::1`.
    Loopback,
    /// RFC 1918 (`10/8`, `172.16/12`, `192.168/16`).
    Private,
    /// `100.64.0.0/10` (carrier-grade NAT).
    Shared,
    /// `169.254.0.0/16`, `fe80::/10`.
    LinkLocal,
    /// `fc00::/7`.
    UniqueLocal,
    /// A cloud metadata service (`169.254.169.254`, `169.254.170.2`, `100.100.100.200`,
    /// Azure's WireServer `168.63.129.16`, `fd00:ec2::254`): never allowed.
    Metadata,
    /// Multicast (`224/4`, `ff00::/8`) or the limited broadcast address.
    Multicast,
    /// `0.0.0.0/8`, `::`: connecting to it reaches the local host.
    Unspecified,
    /// Documentation ranges (`192.0.2/24`, `198.51.100/24`, `203.0.113/24`, `2001:db8::/32`,
    /// `3fff::/20`).
    Documentation,
    /// Any other special-purpose range (IETF protocol assignments, benchmarking, reserved,
    /// discard-only, Teredo, ORCHIDs, segment routing, …).
    Reserved,
    /// An address of one of this machine's own interfaces, in no special range (its public
    /// address): a request to it reaches the daemon's host, whose services may trust it.
    /// Never answered by [`classify`], which knows ranges only; the guard checks it apart
    /// (`is_this_host`).
    ThisHost,
}

impl AddressClass {
    /// Whether `allow_private_endpoints` lets a request connect to this range.
    pub fn private_endpoint(self) -> bool {
        matches!(
            self,
            AddressClass::Loopback
                | AddressClass::Private
                | AddressClass::Shared
                | AddressClass::LinkLocal
                | AddressClass::UniqueLocal
                | AddressClass::ThisHost
        )
    }

    /// The reason label of a request refused for this range.
    pub fn reason(self) -> BlockReason {
        match self {
            AddressClass::Loopback => BlockReason::Loopback,
            AddressClass::Private => BlockReason::Private,
            AddressClass::Shared => BlockReason::Shared,
            AddressClass::LinkLocal => BlockReason::LinkLocal,
            AddressClass::UniqueLocal => BlockReason::UniqueLocal,
            AddressClass::Metadata => BlockReason::Metadata,
            AddressClass::Multicast => BlockReason::Multicast,
            AddressClass::Unspecified => BlockReason::Unspecified,
            AddressClass::Documentation => BlockReason::Documentation,
            AddressClass::Reserved => BlockReason::Reserved,
            AddressClass::ThisHost => BlockReason::ThisHost,
        }
    }
}

/// Whether a model request may connect to `ip`: `Err` names the range it is refused for.
pub fn allowed(ip: IpAddr, allow_private_endpoints: bool) -> Result<(), AddressClass> {
    match classify(ip) {
        None => Ok(()),
        Some(class) if allow_private_endpoints && class.private_endpoint() => Ok(()),
        Some(class) => Err(class),
    }
}

/// Whether `ip` is one of `host_addresses` (this machine's), an IPv4 address inside an IPv6
/// one ([`embedded_v4`]) compared as itself.
pub fn is_this_host(ip: IpAddr, host_addresses: &[IpAddr]) -> bool {
    let plain = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => embedded_v4(v6).map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let ip = plain(ip);
    host_addresses.iter().any(|own| plain(*own) == ip)
}

/// The special-purpose range of `ip`, or `None` for an ordinary global unicast address.
pub fn classify(ip: IpAddr) -> Option<AddressClass> {
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

/// The cloud metadata services, checked before the ranges that contain them.
const METADATA: &[IpAddr] = &[
    IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)),
    IpAddr::V4(Ipv4Addr::new(169, 254, 170, 2)),
    IpAddr::V4(Ipv4Addr::new(169, 254, 170, 23)),
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
    // Azure's WireServer (a public address every Azure VM reaches: its host agent's
    // configuration, certificates included).
    IpAddr::V4(Ipv4Addr::new(168, 63, 129, 16)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x23)),
    // Google Cloud's metadata server over IPv6.
    IpAddr::V6(Ipv6Addr::new(0xfd20, 0xce, 0, 0, 0, 0, 0, 0x254)),
];

fn v4(a: u8, b: u8, c: u8, d: u8, prefix: u8) -> Ipv4Net {
    // Every prefix below is at most 32, so this cannot fail.
    Ipv4Net::new(Ipv4Addr::new(a, b, c, d), prefix).unwrap_or_default()
}

fn v6(segments: [u16; 8], prefix: u8) -> Ipv6Net {
    let [a, b, c, d, e, f, g, h] = segments;
    // Every prefix below is at most 128, so this cannot fail.
    Ipv6Net::new(Ipv6Addr::new(a, b, c, d, e, f, g, h), prefix).unwrap_or_default()
}

fn v4_ranges() -> [(Ipv4Net, AddressClass); 17] {
    use AddressClass::*;
    [
        (v4(0, 0, 0, 0, 8), Unspecified),
        (v4(10, 0, 0, 0, 8), Private),
        (v4(100, 64, 0, 0, 10), Shared),
        (v4(127, 0, 0, 0, 8), Loopback),
        (v4(169, 254, 0, 0, 16), LinkLocal),
        (v4(172, 16, 0, 0, 12), Private),
        (v4(192, 0, 0, 0, 24), Reserved),
        (v4(192, 0, 2, 0, 24), Documentation),
        (v4(192, 31, 196, 0, 24), Reserved),
        (v4(192, 52, 193, 0, 24), Reserved),
        (v4(192, 88, 99, 0, 24), Reserved),
        (v4(192, 168, 0, 0, 16), Private),
        (v4(192, 175, 48, 0, 24), Reserved),
        (v4(198, 18, 0, 0, 15), Reserved),
        (v4(198, 51, 100, 0, 24), Documentation),
        (v4(203, 0, 113, 0, 24), Documentation),
        (v4(224, 0, 0, 0, 4), Multicast),
    ]
}

fn classify_v4(ip: Ipv4Addr) -> Option<AddressClass> {
    if METADATA.contains(&IpAddr::V4(ip)) {
        return Some(AddressClass::Metadata);
    }
    if ip == Ipv4Addr::BROADCAST {
        return Some(AddressClass::Multicast);
    }
    if let Some((_, class)) = v4_ranges().into_iter().find(|(net, _)| net.contains(&ip)) {
        return Some(class);
    }
    // 240.0.0.0/4: reserved for future use.
    if ip.octets()[0] >= 240 {
        return Some(AddressClass::Reserved);
    }
    None
}

/// The IPv4 address an IPv6 address carries and stands for, if any: IPv4-mapped
/// (`::ffff:a.b.c.d`), IPv4-compatible (`::a.b.c.d`, deprecated), 6to4 (`2002:AABB:CCDD::/48`)
/// and the well-known NAT64 prefix (`64:ff9b::/96`). The local-use NAT64 prefix
/// (`64:ff9b:1::/48`) is not read: the IPv4 address sits where the operator's prefix length
/// puts it (RFC 6052: /48 to /96), so it is classified as a whole instead (reserved).
pub fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let tail = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if let Some(mapped) = ip.to_ipv4_mapped() {
        return Some(mapped);
    }
    // IPv4-compatible: `::a.b.c.d` (but not `::` and `::1`, which are IPv6's own).
    if s[..6] == [0; 6] && (s[6] != 0 || s[7] > 1) {
        return Some(tail);
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(
            (s[1] >> 8) as u8,
            s[1] as u8,
            (s[2] >> 8) as u8,
            s[2] as u8,
        ));
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(tail);
    }
    None
}

fn v6_ranges() -> [(Ipv6Net, AddressClass); 12] {
    use AddressClass::*;
    [
        (v6([0, 0, 0, 0, 0, 0, 0, 0], 128), Unspecified),
        (v6([0, 0, 0, 0, 0, 0, 0, 1], 128), Loopback),
        (v6([0x0100, 0, 0, 0, 0, 0, 0, 0], 64), Reserved),
        // Local-use NAT64 (RFC 8215): where the IPv4 address sits depends on the operator's
        // prefix length, so none of it is taken for a global address.
        (v6([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48), Reserved),
        (v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 23), Reserved),
        (v6([0x2001, 0x0db8, 0, 0, 0, 0, 0, 0], 32), Documentation),
        (v6([0x3fff, 0, 0, 0, 0, 0, 0, 0], 20), Documentation),
        (v6([0x5f00, 0, 0, 0, 0, 0, 0, 0], 16), Reserved),
        (v6([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7), UniqueLocal),
        (v6([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10), LinkLocal),
        (v6([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10), LinkLocal),
        (v6([0xff00, 0, 0, 0, 0, 0, 0, 0], 8), Multicast),
    ]
}

fn classify_v6(ip: Ipv6Addr) -> Option<AddressClass> {
    if METADATA.contains(&IpAddr::V6(ip)) {
        return Some(AddressClass::Metadata);
    }
    if let Some(inner) = embedded_v4(ip) {
        // An address that stands for an IPv4 one is what that one is; a translator prefix
        // around a global IPv4 address is still a translator to reach it through.
        return classify_v4(inner);
    }
    if let Some((_, class)) = v6_ranges()
        .into_iter()
        .find(|(range, _)| range.contains(&ip))
    {
        return Some(class);
    }
    // Only 2000::/3 is allocated global unicast; everything else is reserved.
    if ip.segments()[0] & 0xe000 != 0x2000 {
        return Some(AddressClass::Reserved);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use AddressClass::*;

    fn class(text: &str) -> Option<AddressClass> {
        classify(text.parse().unwrap())
    }

    #[test]
    fn every_special_purpose_range_of_ipv4_is_classified() {
        let table: &[(&str, Option<AddressClass>)] = &[
            ("0.0.0.0", Some(Unspecified)),
            ("0.1.2.3", Some(Unspecified)),
            ("10.0.0.1", Some(Private)),
            ("10.255.255.255", Some(Private)),
            ("100.64.0.1", Some(Shared)),
            ("100.127.255.254", Some(Shared)),
            ("100.100.100.200", Some(Metadata)),
            ("168.63.129.16", Some(Metadata)),
            ("168.63.129.17", None),
            ("127.0.0.1", Some(Loopback)),
            ("127.255.0.9", Some(Loopback)),
            ("169.254.0.1", Some(LinkLocal)),
            ("169.254.169.254", Some(Metadata)),
            ("169.254.170.2", Some(Metadata)),
            ("172.16.0.1", Some(Private)),
            ("172.31.255.255", Some(Private)),
            ("192.0.0.8", Some(Reserved)),
            ("192.0.2.10", Some(Documentation)),
            ("192.168.1.1", Some(Private)),
            ("198.18.0.1", Some(Reserved)),
            ("198.19.255.255", Some(Reserved)),
            ("198.51.100.7", Some(Documentation)),
            ("203.0.113.5", Some(Documentation)),
            ("224.0.0.1", Some(Multicast)),
            ("239.255.255.250", Some(Multicast)),
            ("240.0.0.1", Some(Reserved)),
            ("255.255.255.255", Some(Multicast)),
            // Neighbours of the ranges are ordinary addresses.
            ("9.255.255.255", None),
            ("11.0.0.0", None),
            ("100.63.255.255", None),
            ("100.128.0.0", None),
            ("172.15.255.255", None),
            ("172.32.0.0", None),
            ("192.167.255.255", None),
            ("198.20.0.0", None),
            ("223.255.255.255", None),
            ("8.8.8.8", None),
            ("140.82.112.3", None),
        ];
        for (ip, want) in table {
            assert_eq!(class(ip), *want, "{ip}");
        }
    }

    #[test]
    fn ipv6_ranges_and_every_ipv4_embedding_are_classified() {
        let table: &[(&str, Option<AddressClass>)] = &[
            ("::", Some(Unspecified)),
            ("::1", Some(Loopback)),
            ("fe80::1", Some(LinkLocal)),
            ("febf::1", Some(LinkLocal)),
            ("fec0::1", Some(LinkLocal)),
            ("fc00::1", Some(UniqueLocal)),
            ("fd12:3456::1", Some(UniqueLocal)),
            ("fd00:ec2::254", Some(Metadata)),
            ("fd20:ce::254", Some(Metadata)),
            ("ff02::1", Some(Multicast)),
            ("2001:db8::1", Some(Documentation)),
            ("3fff:1::1", Some(Documentation)),
            ("100::1", Some(Reserved)),
            ("2001::1", Some(Reserved)),
            ("2001:10::1", Some(Reserved)),
            ("4000::1", Some(Reserved)),
            ("::ffff:0:1", Some(Unspecified)),
            // IPv4-mapped, IPv4-compatible, 6to4 and NAT64 forms are what they carry.
            ("::ffff:127.0.0.1", Some(Loopback)),
            ("::ffff:7f00:1", Some(Loopback)),
            ("::ffff:10.1.2.3", Some(Private)),
            ("::ffff:169.254.169.254", Some(Metadata)),
            ("::127.0.0.1", Some(Loopback)),
            ("::10.0.0.1", Some(Private)),
            ("2002:7f00:1::", Some(Loopback)),
            ("2002:a9fe:a9fe::1", Some(Metadata)),
            ("2002:c0a8:101::1", Some(Private)),
            ("64:ff9b::7f00:1", Some(Loopback)),
            ("64:ff9b::10.0.0.1", Some(Private)),
            ("64:ff9b::169.254.169.254", Some(Metadata)),
            // Local-use NAT64: the IPv4 address may sit anywhere (169.254.169.254 in the /48
            // layout here, 8.8.8.8 read from the last 32 bits): none of it is global.
            ("64:ff9b:1::a00:1", Some(Reserved)),
            ("64:ff9b:1:a9fe:a9:fe00:808:808", Some(Reserved)),
            ("::ffff:8.8.8.8", None),
            ("2002:808:808::1", None),
            ("64:ff9b::8.8.8.8", None),
            ("2606:4700::1111", None),
            ("2a00:1450:4001::200e", None),
        ];
        for (ip, want) in table {
            assert_eq!(class(ip), *want, "{ip}");
        }
    }

    #[test]
    fn the_switch_opens_private_ranges_but_never_metadata_or_unspecified() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        for private in [
            "127.0.0.1",
            "::1",
            "10.0.0.1",
            "100.64.0.1",
            "fd00::1",
            "169.254.1.1",
        ] {
            assert!(allowed(ip(private), false).is_err(), "{private}");
            assert!(allowed(ip(private), true).is_ok(), "{private}");
        }
        for never in [
            "169.254.169.254",
            "fd00:ec2::254",
            "fd20:ce::254",
            "0.0.0.0",
            "::",
            "224.0.0.1",
            "192.0.2.1",
            "240.0.0.1",
            "::ffff:169.254.169.254",
        ] {
            assert!(allowed(ip(never), true).is_err(), "{never}");
        }
        assert_eq!(allowed(ip("8.8.8.8"), false), Ok(()));
    }
}
