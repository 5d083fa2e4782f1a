#!/usr/bin/env bash
# Installs the Debian packages whose files the real-text corpora read (proxykv_hf/eval/corpora.py):
#   python3.11-doc      -> pydocs    (train; PSF-2.0)
#   manpages            -> manpages  (test; GPL-2+ and others, see /usr/share/doc/manpages/copyright)
#   perl-modules-5.36   -> perl      (test; Artistic-1.0 or GPL-1+)
# pycode (the CPython standard library) and readmes (installed Python distributions) need nothing more; the
# filler corpora are built in. Then `proxykv corpora` shows what was found.
set -euo pipefail
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq python3.11-doc manpages perl-modules-5.36
