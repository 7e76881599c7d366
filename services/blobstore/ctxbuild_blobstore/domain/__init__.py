"""Pure blob-store logic (no I/O): fs_read and read_file paging, prefix resolution, attachment handles."""

from .fsread import fs_read_error, fs_read_page, resolve_prefix, split_lines
from .handles import unique_handle
from .readfile import read_file_error, read_file_page

__all__ = [
           "fs_read_error",
           "fs_read_page",
           "read_file_error",
           "read_file_page",
           "resolve_prefix",
           "split_lines",
           "unique_handle",
]
