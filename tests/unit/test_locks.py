import pytest

from vmmgr.errors import Conflict
from vmmgr.locks import vm_operation


def test_second_operation_on_the_same_vm_is_refused_with_the_holder(tmp_path):
    with vm_operation(tmp_path, "vm1", "migration to host2"):
        with pytest.raises(Conflict, match="vm1.*busy.*migration to host2"):
            with vm_operation(tmp_path, "vm1", "destroy"):
                pass
        with vm_operation(tmp_path, "vm2", "destroy"):  # other VMs are free
            pass
    with vm_operation(tmp_path, "vm1", "destroy"):  # released afterwards
        pass


def test_lock_is_released_when_the_operation_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with vm_operation(tmp_path, "vm1", "x"):
            raise RuntimeError
    with vm_operation(tmp_path, "vm1", "y"):
        pass
