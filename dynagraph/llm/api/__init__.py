"""The OpenAI API's request and response types and the pure logic behind its options.

Nothing here does I/O. The Frontend validates requests with :mod:`.requests`; the
Processor turns them into engine requests (:mod:`.sampling`, :mod:`.structured`,
:mod:`.tools`) and formats what comes back (:mod:`.logprobs`); both sides share the
response shapes in :mod:`.responses`.
"""
