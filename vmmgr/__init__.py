"""vmmgr: resumable compute on QEMU/KVM.

The core package. It talks to libvirt and knows nothing of Flask or Celery; the web console and
the task API are thin layers over it.
"""
