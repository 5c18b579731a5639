"""The lab's certificates: signed by its CA, and no key left in a scratch folder."""

import subprocess
import tempfile

from vmmgr.lab_pki import LabPKI


def test_certificates_are_signed_by_the_ca_and_no_scratch_folder_stays(tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    pki = LabPKI(tmp_path / "root", tmp_path / "home")
    pki.ensure()
    pki.install_host(tmp_path / "etc", "host1", "10.0.0.1")
    for cert in (tmp_path / "etc/libvirt/servercert.pem", pki.client_dir / "clientcert.pem"):
        out = subprocess.run(["openssl", "verify", "-CAfile", pki.ca_cert, cert],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in",
                           tmp_path / "etc/qemu/server-cert.pem"],
                          capture_output=True, text=True, check=True).stdout
    assert "IP Address:10.0.0.1" in text  # QEMU's client checks the address it dialled
    assert (tmp_path / "etc/libvirt/private/serverkey.pem").stat().st_mode & 0o777 == 0o600
    assert list(scratch.iterdir()) == []  # the keys were in it
