"""The plugin machinery: the markers (:mod:`.markers`: ``@hookimpl``), every hook a plugin
can implement (:mod:`.hookspecs`), and the plugin manager that finds, blocks, checks and
traces plugins (:mod:`.manager`).

Plugin authors need only ``from ddpx import hookimpl``.
"""
