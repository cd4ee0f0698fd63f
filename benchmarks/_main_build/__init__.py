"""main's builder as of 95673f2 (before issue 34), verbatim but for one import, so build_speed.py can
time today's builder and the new one in the same run on a machine without git history (the GPU host
gets a copy of the working tree only). It shares diagnostics, candidates and the sandbox with the
package, which issue 34 did not change."""
