"""Certificates and keys for a deployment: TLS between the SuperNodes and the SuperLink, and
SuperNode authentication (``docs/deployment.md``), made with the ``cryptography`` package.

:func:`make_certificates` writes, in one folder:

* ``ca.key`` / ``ca.crt``: a certificate authority (RSA 4096, self-signed). The sites and the
  ``flwr`` CLI trust ``ca.crt``; ``ca.key`` stays with whoever runs the federation.
* ``server.key`` / ``server.pem``: the SuperLink's TLS certificate, signed by the CA, valid for
  the host names and IP addresses given (``subjectAltName``; the sites connect by one of them).
* ``<site>`` / ``<site>.pub``: a SuperNode authentication key pair per site (ECDSA P-384, OpenSSH
  format, as ``ssh-keygen -t ecdsa -b 384`` writes it). The public key is registered with
  ``flwr supernode register <site>.pub <federation>``; the private key stays at the site.

In a real federation the hospital's own PKI may issue the server certificate instead; the files
and flags are the same. Private keys are written with mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes, private: bool) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_certificates(folder: Path, hosts: list[str] = ("localhost", "127.0.0.1", "::1"),
                      sites: list[str] = (), days: int = 365) -> Path:
    """A CA, the SuperLink's certificate for ``hosts`` (DNS names or IP addresses) and one
    authentication key pair per name in ``sites``, in ``folder`` (created). Existing files are
    replaced. Returns ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=4096)
    ca = (x509.CertificateBuilder().subject_name(_name("medpfl federation CA")).issuer_name(_name("medpfl federation CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=4096)
    alt: list[x509.GeneralName] = []
    for h in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    server = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca.subject)
              .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
              .add_extension(x509.SubjectAlternativeName(alt), critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    pkcs8 = dict(encoding=pem, format=serialization.PrivateFormat.TraditionalOpenSSL,
                 encryption_algorithm=serialization.NoEncryption())
    _write(folder / "ca.key", ca_key.private_bytes(**pkcs8), True)
    _write(folder / "ca.crt", ca.public_bytes(pem), False)
    _write(folder / "server.key", server_key.private_bytes(**pkcs8), True)
    _write(folder / "server.pem", server.public_bytes(pem), False)
    for s in sites:
        make_site_key(folder, s)
    return folder


def make_site_key(folder: Path, site: str) -> Path:
    """A SuperNode authentication key pair ``<site>`` (private, OpenSSH) and ``<site>.pub``;
    returns the private key's path."""
    key = ec.generate_private_key(ec.SECP384R1())
    priv = Path(folder) / site
    _write(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                   serialization.NoEncryption()), True)
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(priv.with_name(site + ".pub"), pub + f" medpfl-{site}\n".encode(), False)
    return priv
