"""Pure blob-store logic (no I/O): fs_read and read_file paging, prefix resolution, attachment handles, the
streaming text index, object keys and GC rules."""

from .fsread import LinePager, count_lines, fs_read_error, fs_read_page, resolve_prefix, split_lines
from .handles import unique_handle
from .readfile import CharPager, read_file_error, read_file_page
from .textindex import Indexer, Marks, TextIndex, index_bytes

__all__ = [
           "CharPager",
           "Indexer",
           "LinePager",
           "Marks",
           "TextIndex",
           "count_lines",
           "fs_read_error",
           "fs_read_page",
           "index_bytes",
           "read_file_error",
           "read_file_page",
           "resolve_prefix",
           "split_lines",
           "unique_handle",
]
