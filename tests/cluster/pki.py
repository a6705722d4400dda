"""Certificates for the local cluster: one CA, serving and client certs, the SA key pair."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)


@dataclass(frozen=True)
class CertSpec:
    name: str
    common_name: str
    organization: str | None = None
    server: bool = False
    client: bool = True
    dns_names: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


class PKI:
    """Creates everything once under `root`; later calls reuse the files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.ca_cert_path = root / "ca.crt"
        self.ca_key_path = root / "ca.key"
        if not self.ca_cert_path.exists():
            self._make_ca()
        self._ca_key = serialization.load_pem_private_key(self.ca_key_path.read_bytes(), None)
        self._ca_cert = x509.load_pem_x509_certificate(self.ca_cert_path.read_bytes())

    def _make_ca(self) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name("ember-local-ca"))
            .issuer_name(_name("ember-local-ca"))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY * 10)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        _write_key(self.ca_key_path, key)
        self.ca_cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, spec: CertSpec) -> tuple[Path, Path]:
        crt, key_path = self.root / f"{spec.name}.crt", self.root / f"{spec.name}.key"
        if crt.exists() and key_path.exists():
            return crt, key_path
        key = ec.generate_private_key(ec.SECP256R1())
        usages = []
        if spec.server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if spec.client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(spec.common_name, spec.organization))
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in spec.dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in spec.ips]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        assert isinstance(self._ca_key, ec.EllipticCurvePrivateKey)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        _write_key(key_path, key)
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return crt, key_path

    def service_account_keys(self) -> tuple[Path, Path]:
        priv, pub = self.root / "sa.key", self.root / "sa.pub"
        if not priv.exists():
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            _write_key(priv, key)
            pub.write_bytes(
                key.public_key().public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
            )
        return priv, pub
